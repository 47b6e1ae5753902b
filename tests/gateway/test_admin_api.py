"""Admin API on a real Redis: registering an adapter checks its names, tenants, flag and path (inside an
adapter root, symlinks followed, a PEFT adapter); delete and pin; API keys are created, listed by id and
revoked by an unambiguous id prefix; workers as the fleet sees them. Admin only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from gateway.admin_api import AdminRoutes
from gateway.auth import Authenticator, key_digest
from gateway.errors import APIError
from gateway.fleet import Fleet
from gateway.model_catalog import ModelCatalog
from gateway.settings import GatewaySettings
from loragate import contracts
from loragate.messages import AdapterRecord, WorkerState

ADMIN = "admin-t"


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    """An adapter root holding one PEFT adapter (`good`), a folder without a config and, outside the root, an
    adapter reached through a symlink."""
    root = tmp_path / "root"
    (root / "good").mkdir(parents=True)
    (root / "good" / "adapter_config.json").write_text("{}")
    (root / "empty").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (root / "escape").symlink_to(outside)
    return root


def _request(body: Any = None, token: str = ADMIN, **path_params: str) -> Request:
    raw = b"" if body is None else json.dumps(body).encode()
    sent = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> Message:
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    headers = [(b"authorization", f"Bearer {token}".encode())]
    return Request({"type": "http", "headers": headers, "path_params": path_params}, receive)


Body = Callable[[AdminRoutes, aioredis.Redis], Awaitable[Any]]


def _run(redis_url: str, root: Path | None, body: Body) -> Any:
    async def main() -> Any:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        roots = (root.resolve(),) if root is not None else ()
        state = WorkerState("w1", "tiny", "/m", 512, running=2)

        async def refresh() -> None:
            pass

        fleet = SimpleNamespace(workers={"w1": SimpleNamespace(state=state, queue_len=4)}, refresh=refresh)
        settings = GatewaySettings(redis_url=redis_url, admin_token=ADMIN, adapter_roots=roots)
        ctx = SimpleNamespace(
            settings=settings,
            redis=r,
            fleet=fleet,
            catalog=ModelCatalog(r, cast(Fleet, fleet)),
            auth=Authenticator(settings, r),
        )
        try:
            return await body(AdminRoutes(ctx), r)  # type: ignore[arg-type]
        finally:
            await r.aclose()

    return asyncio.run(main())


def _json(response: Response) -> Any:
    return json.loads(bytes(response.body))


def _refusal(redis_url: str, root: Path | None, body: Body) -> APIError:
    with pytest.raises(APIError) as e:
        _run(redis_url, root, body)
    return e.value


def _put(body: Any, base: str = "tiny", name: str = "a") -> Body:
    async def call(routes: AdminRoutes, _: aioredis.Redis) -> Response:
        return await routes.put_adapter(_request(body, base=base, name=name))

    return call


def test_register_list_pin_and_delete_an_adapter(redis_url: str, roots: Path) -> None:
    path = str(roots / "good")

    async def call(routes: AdminRoutes, r: aioredis.Redis) -> list[Any]:
        put = await routes.put_adapter(_request({"path": path, "tenants": ["t1"]}, base="tiny", name="a"))
        listed = _json(await routes.list_adapters(_request()))
        pinned = _json(await routes.pin_adapter(_request({}, base="tiny", name="a")))
        unpinned = _json(await routes.pin_adapter(_request({"pinned": False}, base="tiny", name="a")))
        deleted = await routes.delete_adapter(_request(base="tiny", name="a"))
        stored = await r.hget(contracts.ADAPTERS, "tiny:a")
        return [
            put.status_code,
            _json(put),
            listed,
            pinned["pinned"],
            unpinned["pinned"],
            deleted.status_code,
            stored,
        ]

    put_status, put, listed, pinned, unpinned, deleted, stored = _run(redis_url, roots, call)
    record = {
        "name": "a",
        "base": "tiny",
        "path": str((roots / "good").resolve()),
        "tenants": ["t1"],
        "pinned": False,
    }
    assert (put_status, put, listed) == (201, record, {"adapters": [record]})
    assert (pinned, unpinned, deleted, stored) == (True, False, 204, None)


def test_a_registered_adapter_is_what_the_record_says(redis_url: str, roots: Path) -> None:
    async def call(routes: AdminRoutes, r: aioredis.Redis) -> AdapterRecord:
        await routes.put_adapter(
            _request({"path": str(roots / "good"), "pinned": True}, base="tiny", name="b")
        )
        return AdapterRecord.from_json(await r.hget(contracts.ADAPTERS, "tiny:b"))

    rec = _run(redis_url, roots, call)
    assert rec == AdapterRecord("b", "tiny", str((roots / "good").resolve()), (), True)


@pytest.mark.parametrize(
    ("body", "base", "name", "status", "param", "code"),
    [
        pytest.param({"path": "good"}, "ti/ny", "a", 400, "base", None, id="base with a slash"),
        pytest.param({"path": "good"}, "tiny", "-a", 400, "name", None, id="name starting with a dash"),
        pytest.param({"path": "good"}, "tiny", "a" * 65, 400, "name", None, id="name too long"),
        pytest.param(
            {"path": "good", "tenants": "t1"}, "tiny", "a", 400, "tenants", None, id="tenants a string"
        ),
        pytest.param({"path": "good", "tenants": [""]}, "tiny", "a", 400, "tenants", None, id="empty tenant"),
        pytest.param(
            {"path": "good", "pinned": "yes"}, "tiny", "a", 400, "pinned", None, id="pinned a string"
        ),
        pytest.param({}, "tiny", "a", 400, "path", None, id="no path"),
        pytest.param({"path": "go\x00od"}, "tiny", "a", 400, "path", None, id="NUL in the path"),
        pytest.param({"path": "empty"}, "tiny", "a", 400, "path", None, id="no adapter_config.json"),
        pytest.param({"path": "missing"}, "tiny", "a", 400, "path", None, id="no such folder"),
        pytest.param(
            {"path": "escape"}, "tiny", "a", 403, "path", "path_not_allowed", id="symlink out of the root"
        ),
        pytest.param({"path": "/etc"}, "tiny", "a", 403, "path", "path_not_allowed", id="outside the root"),
        pytest.param(
            {"path": "good/" + "x" * 300}, "tiny", "a", 400, "path", None, id="name too long for the OS"
        ),
    ],
)
def test_register_refusals(
    redis_url: str,
    roots: Path,
    body: dict[str, Any],
    base: str,
    name: str,
    status: int,
    param: str,
    code: str | None,
) -> None:
    if isinstance(body.get("path"), str) and not body["path"].startswith("/"):
        body = {**body, "path": str(roots / body["path"])}
    error = _refusal(redis_url, roots, _put(body, base, name))
    assert (error.status, error.param, error.code) == (status, param, code), error.message


def test_without_adapter_roots_nothing_can_be_registered(redis_url: str, roots: Path) -> None:
    error = _refusal(redis_url, None, _put({"path": str(roots / "good")}))
    assert error.param == "path" and "No adapter_roots" in error.message


@pytest.mark.parametrize("method", ["delete_adapter", "pin_adapter"])
def test_delete_or_pin_an_unknown_adapter_is_404(redis_url: str, method: str) -> None:
    async def call(routes: AdminRoutes, _: aioredis.Redis) -> Response:
        return await getattr(routes, method)(_request({}, base="tiny", name="nope"))

    error = _refusal(redis_url, None, call)
    assert (error.status, error.code) == (404, "adapter_not_found")


def test_pin_needs_a_boolean(redis_url: str) -> None:
    async def call(routes: AdminRoutes, _: aioredis.Redis) -> Response:
        return await routes.pin_adapter(_request({"pinned": 1}, base="tiny", name="a"))

    assert _refusal(redis_url, None, call).param == "pinned"


def test_keys_are_created_listed_and_revoked(redis_url: str) -> None:
    async def call(routes: AdminRoutes, r: aioredis.Redis) -> list[Any]:
        created = await routes.create_key(_request({"tenant": "team-a"}))
        key = _json(created)
        stored = await r.hget(contracts.API_KEYS, key_digest(key["key"]))
        listed = _json(await routes.list_keys(_request()))
        deleted = await routes.delete_key(_request(key_id=key["key_id"][:8]))
        return [
            created.status_code,
            key,
            stored,
            listed,
            deleted.status_code,
            await r.hlen(contracts.API_KEYS),
        ]

    status, key, stored, listed, deleted, left = _run(redis_url, None, call)
    assert status == 201 and key["tenant"] == "team-a" and key["key"].startswith("sk-lg-")
    assert key["key_id"] == key_digest(key["key"])[:16] and stored == b"team-a"
    assert listed == {"keys": [{"key_id": key["key_id"], "tenant": "team-a"}]}  # never the key itself
    assert (deleted, left) == (204, 0)


@pytest.mark.parametrize(
    ("key_id", "why"),
    [
        pytest.param("abc", "shorter than 8", id="short id"),
        pytest.param("ffffffffffff", "no match", id="unknown id"),
    ],
)
def test_revoking_needs_an_id_of_one_key(redis_url: str, key_id: str, why: str) -> None:
    async def call(routes: AdminRoutes, r: aioredis.Redis) -> Response:
        await r.hset(contracts.API_KEYS, "abc" + "0" * 61, "t1")
        return await routes.delete_key(_request(key_id=key_id))

    error = _refusal(redis_url, None, call)
    assert (error.status, error.code) == (404, "key_not_found"), why


def test_an_id_prefix_of_two_keys_revokes_neither(redis_url: str) -> None:
    async def call(routes: AdminRoutes, r: aioredis.Redis) -> tuple[APIError, int]:
        await r.hset(contracts.API_KEYS, mapping={"abcdef01" + "0" * 56: "t1", "abcdef01" + "1" * 56: "t2"})
        with pytest.raises(APIError) as e:
            await routes.delete_key(_request(key_id="abcdef01"))
        return e.value, await r.hlen(contracts.API_KEYS)

    error, left = _run(redis_url, None, call)
    assert error.status == 404 and left == 2


@pytest.mark.parametrize("tenant", [None, "", "a b", 7])
def test_a_key_needs_a_tenant_name(redis_url: str, tenant: object) -> None:
    async def call(routes: AdminRoutes, _: aioredis.Redis) -> Response:
        return await routes.create_key(_request({"tenant": tenant}))

    assert _refusal(redis_url, None, call).param == "tenant"


def test_workers(redis_url: str) -> None:
    async def call(routes: AdminRoutes, _: aioredis.Redis) -> Any:
        return _json(await routes.workers(_request()))

    (worker,) = _run(redis_url, None, call)["workers"]
    assert (worker["worker_id"], worker["model"], worker["running"], worker["queue_len"]) == (
        "w1",
        "tiny",
        2,
        4,
    )


@pytest.mark.parametrize(
    "method",
    ["workers", "list_adapters", "put_adapter", "delete_adapter", "pin_adapter", "create_key", "list_keys",
     "delete_key"],
)  # fmt: skip
def test_every_endpoint_needs_the_admin_token(redis_url: str, method: str) -> None:
    async def call(routes: AdminRoutes, _: aioredis.Redis) -> Response:
        request = _request({}, token="sk-nope", base="tiny", name="a", key_id="abcdefgh")
        return await getattr(routes, method)(request)

    assert _refusal(redis_url, None, call).status == 401
