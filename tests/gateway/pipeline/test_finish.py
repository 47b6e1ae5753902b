"""Stage finish: the inter-token latency, and a finished request settles its tenant's charge to the
tokens served."""

from __future__ import annotations

import time

import pytest

from gateway.context import GatewayContext
from gateway.model_catalog import Target
from gateway.pipeline.admit import Charge
from gateway.pipeline.finish import Finish, inter_token_s
from loragate.messages import OutputEvent
from policies.fairness import FairQueue, token_cost
from policies.types import Outcome, RouteDecision
from tests.gateway.pipeline.live_context import BASE, TENANT, call, run


@pytest.mark.parametrize(
    ("tokens", "first", "last", "expected"),
    [(0, 1.0, 2.0, None), (1, 1.0, 2.0, None), (2, 1.0, 2.0, 1.0), (5, 1.0, 2.0, 0.25)],
    ids=["no tokens", "one token", "two tokens", "five tokens"],
)
def test_inter_token_s(tokens: int, first: float, last: float, expected: float | None) -> None:
    assert inter_token_s(tokens, first, last) == expected


def test_finish_settles_the_charge_to_the_tokens_served(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        charge = Charge(ctx.admission, TENANT, BASE, token_cost(40, 100))
        queue = ctx.admission.queues.setdefault(BASE, FairQueue())
        start = queue.counter(TENANT)
        decision = RouteDecision("d1", "default", Outcome.ROUTED, "w-a", "test", predicted_cached_tokens=16)
        now = time.monotonic()
        finish = Finish(ctx, call(), "req-1", Target(BASE, None), decision, charge, now - 1)
        finish(
            OutputEvent(finish_reason="stop", prompt_tokens=40, completion_tokens=8, cached_tokens=16), now
        )
        assert charge.settled
        finish(OutputEvent(finish_reason="stop", prompt_tokens=40, completion_tokens=8), now)  # settled once
        assert queue.counter(TENANT) - start == pytest.approx(token_cost(40, 8) - token_cost(40, 100))

    run(redis_url, body)
