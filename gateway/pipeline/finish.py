"""Stage finish: what a request this handler queued records when its last event arrives — latency and
token metrics, the decision's predicted against actual cached tokens, the tenant's charge corrected to
the tokens served, and the response attributes of its span."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.context import GatewayContext
from gateway.model_catalog import Target
from gateway.pipeline.admit import Charge
from gateway.pipeline.parse import Call
from loragate.messages import OutputEvent
from policies.types import RouteDecision


@dataclass(frozen=True)
class Finish:
    ctx: GatewayContext
    call: Call
    request_id: str  # the client's
    target: Target
    decision: RouteDecision
    charge: Charge
    started: float  # monotonic, when the request arrived

    def __call__(self, event: OutputEvent, first_at: float) -> None:
        now = time.monotonic()
        ctx, target = self.ctx, self.target
        ctx.metrics.finished(
            target.model_id,
            target.base,
            target.adapter.key if target.adapter else None,
            first_at - self.started,
            now - self.started,
            inter_token_s(event.completion_tokens, first_at, now),
            event.prompt_tokens,
            event.cached_tokens,
            event.completion_tokens,
        )
        ctx.decisions.finished(self.decision, event.cached_tokens)
        self.charge.settle(event.prompt_tokens, event.completion_tokens)
        self.call.server_span.set_attributes(
            {
                "gen_ai.response.id": self.request_id,
                "gen_ai.response.model": target.model_id,
                "gen_ai.response.finish_reasons": [event.finish_reason or ""],
                "gen_ai.usage.input_tokens": event.prompt_tokens,
                "gen_ai.usage.output_tokens": event.completion_tokens,
                "loragate.cached_tokens": event.cached_tokens,
            }
        )


def inter_token_s(completion_tokens: int, first_at: float, last_at: float) -> float | None:
    """Mean time between output tokens after the first; None with fewer than two tokens."""
    return (last_at - first_at) / (completion_tokens - 1) if completion_tokens > 1 else None


def nothing_to_finish(event: OutputEvent, first_at: float) -> None:
    """For a handler that attached to a request another one queued: that one accounts for it."""
