"""Stage enqueue: put the request on its worker's queue (with its record and its routing decision, in
one round trip that also wakes the output relay), or attach to the request when it is there already
(a retry, or a concurrent copy queued first). Every path that does not leave the request queued by this
handler releases its reservation and refunds its admission charge."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from gateway.context import GatewayContext
from gateway.pipeline.admit import Charge
from gateway.pipeline.job import Job
from gateway.pipeline.output import OutputReader
from gateway.relay import EventChannel
from loragate.tracing import span
from policies.routing_state import Reservation
from policies.types import RouteDecision


async def attach(ctx: GatewayContext, job: Job, base: str) -> OutputReader:
    """Relay a request that is live already, from its start; this handler holds no reservation."""
    async with asyncio.timeout(ctx.settings.redis_timeout_s):
        events = await ctx.mux.subscribe(job.qid)
    return OutputReader(ctx, job, base, events, None)


async def enqueue(
    ctx: GatewayContext, job: Job, decision: RouteDecision, reservation: Reservation, charge: Charge
) -> OutputReader:
    now = time.time()
    msg = replace(job.message, deadline=now + ctx.settings.request_timeout_s, enqueued_at=now)
    events: EventChannel | None = None
    with span(ctx.tracer, "enqueue", {"loragate.worker": reservation.worker_id}):
        try:
            # One round trip: the relay's wake-up, the request (with its record) and its decision.
            pipe = ctx.redis.pipeline(transaction=False)
            events = await ctx.mux.subscribe(job.qid, pipe=pipe)
            at = len(pipe)
            job.store.enqueue(pipe, msg, job.fingerprint, reservation.worker_id)
            ctx.decisions.record(decision, job.request_id, pipe)
            async with asyncio.timeout(ctx.settings.redis_timeout_s):
                queued = (await pipe.execute())[at] is not None
            if queued:
                reservation.commit()
                ctx.decisions.count(decision)  # this handler queued it: it accounts for it
                return OutputReader(ctx, job, msg.model, events, reservation)
            # A copy with this id (a concurrent try) was queued first: attach to it.
            reservation.release()
            charge.refund()
            async with asyncio.timeout(ctx.settings.redis_timeout_s):
                await job.store.exists(job.qid, job.fingerprint)  # 409 when it asked for something else
            return OutputReader(ctx, job, msg.model, events, None)
        except BaseException:  # not queued (Redis failed, or a 409): undo what routing counted
            reservation.release()
            charge.refund()
            if events is not None:
                ctx.mux.unsubscribe(job.qid, events)
            raise
