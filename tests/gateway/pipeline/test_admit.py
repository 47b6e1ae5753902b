"""Stage admit: the admission charge is settled exactly once, whichever end comes first."""

from __future__ import annotations

import pytest

from gateway.admission import FairAdmission
from gateway.context import GatewayContext
from gateway.pipeline.admit import Charge, admit
from policies.fairness import token_cost
from tests.gateway.pipeline.live_context import BASE, TENANT, http_request, prompt, run

AMOUNT = token_cost(40, 8)


@pytest.mark.parametrize(
    ("ends", "expected"),
    [
        ([(40, 8)], token_cost(40, 8)),
        ([(40, 3)], token_cost(40, 3)),
        ([None], 0.0),
        ([None, (40, 8)], 0.0),
        ([(40, 3), None], token_cost(40, 3)),
        ([None, None], 0.0),
        ([], AMOUNT),
    ],
    ids=["served as estimated", "served fewer", "refunded", "refund first", "settle first", "twice", "open"],
)
def test_a_charge_settles_once(ends: list[tuple[int, int] | None], expected: float, redis_url: str) -> None:
    """Each end is a settle with (prompt, completion) tokens, or a refund (None)."""

    async def body(ctx: GatewayContext) -> None:
        admission: FairAdmission = ctx.admission
        charge = await admit(ctx, http_request(), TENANT, BASE, prompt(40, 8))
        assert charge.amount == AMOUNT
        start = admission.queues[BASE].counter(TENANT) - AMOUNT
        for end in ends:
            charge.refund() if end is None else charge.settle(*end)
        assert admission.queues[BASE].counter(TENANT) - start == pytest.approx(expected)
        assert charge.settled == bool(ends)

    run(redis_url, body)


def test_a_served_charge_feeds_the_drain_rate_and_a_refund_does_not(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        refunded = Charge(ctx.admission, TENANT, BASE, AMOUNT)
        refunded.refund()
        assert ctx.admission.meter(BASE).tokens_per_request(ctx.admission.clock()) is None
        served = Charge(ctx.admission, TENANT, BASE, AMOUNT)
        served.settle(40, 8)
        assert ctx.admission.meter(BASE).tokens_per_request(ctx.admission.clock()) == 8

    run(redis_url, body)
