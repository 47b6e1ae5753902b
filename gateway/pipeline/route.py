"""Stage route: the policy's input for the request, and the worker it chooses, with what that
reservation holds there (`policies.routing_state`)."""

from __future__ import annotations

import time

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.admit import Charge
from gateway.pipeline.job import Job
from gateway.pipeline.prompt import Prompt
from gateway.pipeline.resolve import Resolved
from gateway.routing import decision_attributes
from loragate.hashing import block_hashes
from loragate.tracing import span
from policies.routing_state import Reservation, make_route_request
from policies.types import RouteDecision, RouteRequest


def route_input(job: Job, resolved: Resolved, prompt: Prompt) -> RouteRequest:
    """What routing sees; the block hashes are the same chained, adapter-keyed ones the worker's prefix
    cache uses."""
    msg, adapter, block_size = job.message, resolved.target.adapter, resolved.block_size
    return make_route_request(
        request_id=job.request_id,
        tenant=msg.tenant,
        base=msg.model,
        adapter=msg.adapter,
        prompt_tokens=len(prompt.token_ids),
        max_tokens=prompt.max_tokens,
        block_hashes=block_hashes(prompt.token_ids, block_size, msg.adapter),
        block_size=block_size,
        now=time.time(),
        allowed_tenants=adapter.tenants if adapter else (),
        prompt_text=prompt.text or "",
    )


def route(
    ctx: GatewayContext, request: RouteRequest, charge: Charge
) -> tuple[RouteDecision, Reservation | None]:
    """The decision and its reservation (None: for the model's shared stream); a refusal (503, 429)
    refunds the admission charge."""
    with span(ctx.tracer, "route") as route_span:
        try:
            decision, reservation = ctx.router.route(request)
        except APIError as e:
            charge.refund()
            route_span.set_attribute("loragate.route.error", e.message)
            raise
        if route_span.is_recording():
            route_span.set_attributes(decision_attributes(decision))
    return decision, reservation
