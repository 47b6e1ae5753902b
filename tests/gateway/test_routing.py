"""The gateway's router (`gateway.routing.Router`) over the app's own context and a real Redis: a routed
request holds its worker until released; no worker is 503 and every worker filtered out is 429, both
counted; the shadow profile is compared on the same request; an alias picks a rung by difficulty and
falls back to the nearest rung that has workers."""

from __future__ import annotations

import copy
import time

import pytest

from gateway.context import GatewayContext
from gateway.errors import APIError
from policies.default_policy import DEFAULT_POLICY
from policies.document import parse_policy
from policies.routing_state import make_route_request
from policies.types import RouteRequest
from tests.gateway.pipeline.live_context import BASE, TENANT, WORKERS, run


def request(base: str = BASE, rid: str = "r-00000001", prefix: int = 1) -> RouteRequest:
    return make_route_request(
        request_id=rid,
        tenant=TENANT,
        base=base,
        adapter=None,
        prompt_tokens=40,
        max_tokens=8,
        block_hashes=(prefix, prefix + 1),
        block_size=16,
        now=time.time(),
    )


def outstanding(ctx: GatewayContext) -> dict[str, int]:
    return {w: v.queue_len for w, v in ctx.fleet.workers.items()}


def test_a_routed_request_holds_its_worker_until_it_is_released(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        decision, reservation = ctx.router.route(request())
        assert decision.worker_id == reservation.worker_id and decision.worker_id in WORKERS
        assert outstanding(ctx)[decision.worker_id] == 1
        assert ctx.router.state.queued_tokens == {decision.worker_id: 40}
        assert reservation.release() and not reservation.release()  # exactly once
        assert outstanding(ctx) == dict.fromkeys(WORKERS, 0) and ctx.router.state.queued_tokens == {}

    run(redis_url, body)


def test_concurrent_requests_spread_before_any_refresh(redis_url: str) -> None:
    """Each reservation counts at once, so back-to-back requests (with prefixes no worker holds) do not
    all land on one worker."""

    async def body(ctx: GatewayContext) -> None:
        held = [ctx.router.route(request(rid=f"r-0000000{i}", prefix=10 * i))[1] for i in range(4)]
        assert outstanding(ctx) == dict.fromkeys(WORKERS, 2)
        for r in held:
            r.release()

    run(redis_url, body)


def test_no_worker_for_the_model_is_503_and_counted(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        with pytest.raises(APIError) as e:
            ctx.router.route(request(base="nobody-serves-this"))
        assert (e.value.status, e.value.code, e.value.headers) == (503, "no_worker", {"Retry-After": "2"})
        assert ctx.decisions.outcomes["no_worker"] == 1
        assert outstanding(ctx) == dict.fromkeys(WORKERS, 0)

    run(redis_url, body)


def test_every_worker_filtered_out_is_429_and_counted(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        doc = copy.deepcopy(DEFAULT_POLICY)
        bound = next(p for p in doc["plugins"] if p["type"] == "queue-bound")
        bound["parameters"]["max_outstanding"] = 1
        ctx.router.holder.policy = parse_policy(doc)
        held = [ctx.router.route(request(rid=f"r-0000000{i}", prefix=10 * i))[1] for i in range(2)]
        assert outstanding(ctx) == dict.fromkeys(WORKERS, 1)  # every worker at its bound
        with pytest.raises(APIError) as e:
            ctx.router.route(request(rid="r-00000009", prefix=90))
        assert (e.value.status, e.value.code, e.value.headers) == (429, "overloaded", {"Retry-After": "1"})
        assert ctx.decisions.outcomes["filtered_out"] == 1
        assert outstanding(ctx) == dict.fromkeys(WORKERS, 1)  # the refused one reserved nothing
        for r in held:
            r.release()

    run(redis_url, body)


def test_the_shadow_profile_is_compared_on_the_same_request(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        shadow = {**DEFAULT_POLICY, "default_profile": "round-robin"}
        ctx.router.holder.shadow = parse_policy(shadow)
        _, reservation = ctx.router.route(request())
        assert ctx.decisions.shadow.compared == 1
        assert outstanding(ctx) == {w: int(w == reservation.worker_id) for w in WORKERS}  # held once
        reservation.release()

    run(redis_url, body)


@pytest.mark.parametrize(
    ("text", "chosen", "fallback"),
    [
        pytest.param("hi", "tiny", False, id="easy: the small rung, which has workers"),
        pytest.param(
            "Prove, step by step and rigorously, " * 60,
            "tiny",
            True,
            id="hard: smollm2 has none, nearest rung",
        ),
    ],
)
def test_an_alias_picks_a_rung_by_difficulty(redis_url: str, text: str, chosen: str, fallback: bool) -> None:
    async def body(ctx: GatewayContext) -> None:
        choice = ctx.router.resolve_alias("auto", text, 512)
        assert choice.model == chosen
        assert ("smollm2 has no worker" in choice.reason) is fallback
        assert 0.0 <= choice.score <= 1.0

    run(redis_url, body)


def test_an_alias_with_no_worker_on_any_rung_is_503(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        ctx.router.state.observe({})  # the fleet as seen now: nobody
        with pytest.raises(APIError) as e:
            ctx.router.resolve_alias("auto", "hi", 16)
        assert (e.value.status, e.value.code) == (503, "no_worker")

    run(redis_url, body)
