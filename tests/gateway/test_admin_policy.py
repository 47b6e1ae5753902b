"""Admin policy endpoints on a real Redis: a document (JSON or YAML) is validated before it is stored,
a bad one is 400 naming the bad field; history, rollback, shadow, decisions and stats; admin only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from gateway.admin_policy import PolicyRoutes
from gateway.auth import Authenticator
from gateway.decisions import DecisionLog
from gateway.errors import APIError
from gateway.policy_store import PolicyHolder, PolicyStore
from gateway.settings import GatewaySettings
from loragate import contracts
from policies.default_policy import DEFAULT_POLICY
from policies.document import parse_policy
from policies.types import Outcome, RouteDecision

ADMIN = "admin-t"
GOOD = json.dumps(DEFAULT_POLICY).encode()


def _request(
    body: bytes = b"",
    content_type: str = "application/json",
    token: str = ADMIN,
    query: bytes = b"",
    path_params: dict[str, str] | None = None,
) -> Request:
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    headers = [(b"authorization", f"Bearer {token}".encode()), (b"content-type", content_type.encode())]
    scope = {"type": "http", "headers": headers, "query_string": query, "path_params": path_params or {}}
    return Request(scope, receive)


Body = Callable[[PolicyRoutes, SimpleNamespace], Awaitable[Any]]


def _run(redis_url: str, body: Body) -> Any:
    async def main() -> Any:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            ctx = SimpleNamespace(
                auth=Authenticator(GatewaySettings(redis_url=redis_url, admin_token=ADMIN), r),
                policy=PolicyHolder(PolicyStore(r), parse_policy, DEFAULT_POLICY, redis_url),
                decisions=DecisionLog(r),
                admission=SimpleNamespace(waited=3),
                kv_events=SimpleNamespace(applied=5),
            )
            return await body(PolicyRoutes(ctx), ctx)  # type: ignore[arg-type]
        finally:
            await r.aclose()

    return asyncio.run(main())


def _json(response: Response) -> Any:
    return json.loads(bytes(response.body))


def _put(body: bytes, content_type: str = "application/json") -> Body:
    async def call(routes: PolicyRoutes, _: SimpleNamespace) -> Response:
        return await routes.put_policy(_request(body, content_type))

    return call


def _refusal(redis_url: str, body: Body) -> APIError:
    with pytest.raises(APIError) as e:
        _run(redis_url, body)
    return e.value


def test_put_a_valid_policy_as_json_makes_it_the_active_version(redis_url: str) -> None:
    async def body(routes: PolicyRoutes, ctx: SimpleNamespace) -> tuple[Any, ...]:
        put = await routes.put_policy(_request(GOOD, query=b"note=hello"))
        got = await routes.get_policy(_request())
        history = await routes.history(_request())
        return put.status_code, _json(put), _json(got), _json(history), ctx.policy.version

    status, put, got, history, version = _run(redis_url, body)
    assert (status, put, version) == (201, {"version": 1}, 1)
    assert got == {"version": 1, "document": DEFAULT_POLICY}
    assert [(v["version"], v["note"], v["active"]) for v in history["versions"]] == [(1, "hello", True)]


def test_put_a_valid_policy_as_yaml(redis_url: str) -> None:
    response = _run(redis_url, _put(yaml.safe_dump(DEFAULT_POLICY).encode(), "application/yaml"))
    assert response.status_code == 201


@pytest.mark.parametrize(
    ("raw", "content_type", "param", "code", "words"),
    [
        pytest.param(b"[1]", "application/json", None, "invalid_policy", "must be an object", id="a list"),
        pytest.param(b"{", "application/json", None, "invalid_json", "not valid JSON", id="broken JSON"),
        pytest.param(b"a: [", "application/yaml", None, "invalid_yaml", "does not parse", id="broken YAML"),
        pytest.param(
            b"a: &x [1]\nb: *x\n",
            "application/yaml",
            None,
            "invalid_yaml",
            "aliases (*name)",
            id="YAML alias",
        ),
        pytest.param(b"d: 2026-01-01\n", "text/yaml", "d", None, "which JSON cannot hold", id="YAML date"),
        pytest.param(
            b"[" * 5000 + b"]" * 5000, "application/yaml", None, None, "nests deeper", id="YAML deep"
        ),
        pytest.param(
            yaml.safe_dump({**DEFAULT_POLICY, "plugins": 1}).encode(),
            "application/yaml",
            "plugins",
            "invalid_policy",
            "must be a list",
            id="bad field",
        ),
        pytest.param(
            json.dumps({**DEFAULT_POLICY, "aliases": {"auto": {"rungs": []}}}).encode(),
            "application/json",
            "aliases.auto.rungs",
            "invalid_policy",
            "needs at least one rung",
            id="alias without rungs",
        ),
    ],
)
def test_put_refuses_a_bad_document_and_stores_nothing(
    redis_url: str, raw: bytes, content_type: str, param: str | None, code: str | None, words: str
) -> None:
    error = _refusal(redis_url, _put(raw, content_type))
    assert (error.status, error.param, error.code) == (400, param, code)
    assert words in error.message, error.message
    r = aioredis.Redis.from_url(redis_url)
    assert asyncio.run(_active(r)) is None


async def _active(r: aioredis.Redis) -> Any:
    try:
        return await r.get(contracts.POLICY_ACTIVE)
    finally:
        await r.aclose()


def test_put_refuses_a_document_over_256_kib(redis_url: str) -> None:
    error = _refusal(redis_url, _put(b"{" + b" " * (256 * 1024) + b"}"))
    assert error.status == 413


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        pytest.param(b'{"version": "1"}', 400, "version", None, id="version a string"),
        pytest.param(b'{"version": true}', 400, "version", None, id="version a boolean"),
        pytest.param(b"", 400, "version", None, id="no body"),
        pytest.param(b'{"version": 7}', 404, None, "policy_version_not_found", id="unknown version"),
    ],
)
def test_rollback_refusals(
    redis_url: str, body: bytes, status: int, param: str | None, code: str | None
) -> None:
    async def call(routes: PolicyRoutes, _: SimpleNamespace) -> Response:
        await routes.put_policy(_request(GOOD))
        return await routes.rollback(_request(body))

    error = _refusal(redis_url, call)
    assert (error.status, error.param, error.code) == (status, param, code)


def test_rollback_makes_a_new_active_version(redis_url: str) -> None:
    other = {**DEFAULT_POLICY, "default_profile": "least-loaded"}

    async def call(routes: PolicyRoutes, ctx: SimpleNamespace) -> tuple[Any, ...]:
        await routes.put_policy(_request(GOOD))
        await routes.put_policy(_request(json.dumps(other).encode()))
        response = await routes.rollback(_request(b'{"version": 1}'))
        return response.status_code, _json(response), ctx.policy.version, ctx.policy.policy.default_profile

    assert _run(redis_url, call) == (201, {"version": 3, "rolled_back_to": 1}, 3, "default")


def test_shadow_put_get_delete(redis_url: str) -> None:
    async def call(routes: PolicyRoutes, ctx: SimpleNamespace) -> list[Any]:
        decision = RouteDecision("d", "default", Outcome.ROUTED, "w1", "r")
        ctx.decisions.shadow.record(decision, decision)
        put = await routes.put_shadow(_request(GOOD))
        got = _json(await routes.get_shadow(_request()))
        deleted = await routes.delete_shadow(_request())
        after = _json(await routes.get_shadow(_request()))
        return [put.status_code, got["document"] == DEFAULT_POLICY, got["report"]["compared"],
                deleted.status_code, after["document"], ctx.policy.shadow]  # fmt: skip

    assert _run(redis_url, call) == [201, True, 0, 204, None, None]  # a new shadow starts a new comparison


def test_put_shadow_validates(redis_url: str) -> None:
    async def call(routes: PolicyRoutes, _: SimpleNamespace) -> Response:
        return await routes.put_shadow(_request(b'{"plugins": []}'))

    assert _refusal(redis_url, call).code == "invalid_policy"


def test_decision_lookup(redis_url: str) -> None:
    decision = RouteDecision("d42", "default", Outcome.SINGLE, "w1", "only one")

    async def call(routes: PolicyRoutes, ctx: SimpleNamespace) -> tuple[Any, APIError]:
        pipe = ctx.decisions.redis.pipeline()
        ctx.decisions.record(decision, "req-1", pipe)
        await pipe.execute()
        found = _json(await routes.decision(_request(path_params={"decision_id": "d42"})))
        with pytest.raises(APIError) as e:
            await routes.decision(_request(path_params={"decision_id": "nope"}))
        return found, e.value

    found, missing = _run(redis_url, call)
    assert (found["decision_id"], found["outcome"], found["request_id"]) == ("d42", "single", "req-1")
    assert (missing.status, missing.code) == (404, "decision_not_found")


def test_stats(redis_url: str) -> None:
    async def call(routes: PolicyRoutes, ctx: SimpleNamespace) -> Any:
        ctx.decisions.count(RouteDecision("d", "default", Outcome.ROUTED, "w1", "r"))
        return _json(await routes.stats(_request()))

    assert _run(redis_url, call) == {
        "outcomes": {"routed": 1},
        "predicted_cached_tokens": 0,
        "actual_cached_tokens": 0,
        "admission_waited": 3,
        "kv_events_applied": 5,
    }


@pytest.mark.parametrize(
    "method", ["get_policy", "put_policy", "history", "rollback", "get_shadow", "put_shadow", "delete_shadow",
               "decision", "stats"],
)  # fmt: skip
def test_every_endpoint_needs_the_admin_token(redis_url: str, method: str) -> None:
    async def call(routes: PolicyRoutes, _: SimpleNamespace) -> Response:
        request = _request(GOOD, token="sk-not-admin", path_params={"decision_id": "d"})
        return await getattr(routes, method)(request)

    assert _refusal(redis_url, call).status == 401
