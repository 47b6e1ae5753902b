"""Stage route: routing sees the request as the worker's prefix cache will, the chosen worker is
reserved at once, and a refusal refunds the admission charge."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.fleet import WorkerView
from gateway.pipeline.admit import Charge
from gateway.pipeline.route import route, route_input
from loragate.hashing import block_hashes
from tests.gateway.pipeline.live_context import BASE, TENANT, WORKERS, job, prompt, resolved, run


def test_route_input_carries_the_prompts_block_hashes(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        asked = route_input(job(ctx, tokens=40), resolved(ctx), prompt(40))
        assert (asked.base, asked.tenant, asked.adapter, asked.request_id) == (
            BASE,
            TENANT,
            None,
            "req-00000001",
        )
        assert asked.prompt_tokens == 40 and asked.max_tokens == 8 and asked.block_size == 16
        assert asked.block_hashes == tuple(block_hashes(prompt(40).token_ids, 16, None)) and asked.now > 0

    run(redis_url, body)


def test_a_routed_request_is_counted_on_its_worker_at_once(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        charge = Charge(ctx.admission, TENANT, BASE, 1.0)
        decision, reservation = route(ctx, route_input(job(ctx), resolved(ctx), prompt(40)), charge)
        assert decision.worker_id == reservation.worker_id and decision.worker_id in WORKERS
        assert ctx.fleet.workers[reservation.worker_id].queue_len == 1
        assert ctx.router.state.queued_tokens == {reservation.worker_id: 40}
        assert not charge.settled
        reservation.release()
        assert (
            ctx.fleet.workers[reservation.worker_id].queue_len == 0 and ctx.router.state.queued_tokens == {}
        )

    run(redis_url, body)


@pytest.mark.parametrize(
    ("base", "outstanding", "status"),
    [("gone", 0, 503), (BASE, 100_000, 429)],
    ids=["no worker", "every worker at its queue bound"],
)
def test_a_refused_request_is_refunded_and_reserves_nothing(
    base: str, outstanding: int, status: int, redis_url: str
) -> None:
    async def body(ctx: GatewayContext) -> None:
        for w, view in ctx.fleet.workers.items():
            ctx.fleet.workers[w] = WorkerView(view.state, outstanding)
        charge = Charge(ctx.admission, TENANT, base, 1.0)
        asked = replace(route_input(job(ctx), resolved(ctx), prompt(40)), base=base)
        with pytest.raises(APIError) as e:
            route(ctx, asked, charge)
        assert e.value.status == status and charge.settled
        assert all(w.queue_len == outstanding for w in ctx.fleet.workers.values())
        assert ctx.router.state.queued_tokens == {}

    run(redis_url, body)
