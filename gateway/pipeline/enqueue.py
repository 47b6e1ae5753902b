"""Stage enqueue: put the request on its worker's queue (with its record and its routing decision, in
one round trip that also wakes the output relay), or attach to the request when it is there already
(a retry, or a concurrent copy queued first). A request no worker could take (no reservation) goes on its
model's shared stream instead, up to `model_queue_max` entries, for the first worker with room. Every
path that does not leave the request queued by this handler releases its reservation and refunds its
admission charge."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.event_channel import EventChannel
from gateway.pipeline.admit import Charge
from gateway.pipeline.job import Job
from gateway.pipeline.output import OutputReader
from gateway.request_store import SHARED_FULL
from loragate import contracts
from loragate.tracing import span
from policies.routing_state import Reservation
from policies.types import RouteDecision


async def attach(ctx: GatewayContext, job: Job, base: str) -> OutputReader:
    """Relay a request that is live already, from its start; this handler holds no reservation."""
    async with asyncio.timeout(ctx.settings.redis_timeout_s):
        events = await ctx.mux.subscribe(base, job.qid)
    return OutputReader(ctx, job, base, events, None)


async def enqueue(
    ctx: GatewayContext, job: Job, decision: RouteDecision, reservation: Reservation | None, charge: Charge
) -> OutputReader:
    """On the chosen worker's queue, or with no `reservation` on the model's shared stream (429 when that
    is full)."""
    now = time.time()
    msg = replace(job.message, deadline=now + ctx.settings.request_timeout_s, enqueued_at=now)
    events: EventChannel | None = None
    where = reservation.worker_id if reservation is not None else contracts.model_queue(msg.model)
    with span(ctx.tracer, "enqueue", {"loragate.worker": where}):
        try:
            # One round trip: the relay's wake-up, the request (with its record) and its decision.
            pipe = ctx.redis.pipeline(transaction=False)
            events = await ctx.mux.subscribe(msg.model, job.qid, pipe=pipe)
            at = len(pipe)
            if reservation is not None:
                job.store.enqueue(pipe, msg, job.fingerprint, reservation.worker_id)
            else:
                job.store.enqueue_shared(pipe, msg, job.fingerprint, ctx.settings.model_queue_max)
            ctx.decisions.record(decision, job.request_id, pipe)
            async with asyncio.timeout(ctx.settings.redis_timeout_s):
                entry = (await pipe.execute())[at]
            if entry == SHARED_FULL:
                raise shared_queue_full(msg.model, ctx.settings.model_queue_max)
            if entry is not None:
                if reservation is not None:
                    reservation.commit()
                ctx.decisions.count(decision)  # this handler queued it: it accounts for it
                return OutputReader(ctx, job, msg.model, events, reservation)
            # A copy with this id (a concurrent try) was queued first: attach to it.
            if reservation is not None:
                reservation.release()
            charge.refund()
            async with asyncio.timeout(ctx.settings.redis_timeout_s):
                await job.store.exists(job.qid, job.fingerprint)  # 409 when it asked for something else
            return OutputReader(ctx, job, msg.model, events, None)
        except BaseException:  # not queued (Redis failed, a 409, a full shared stream): undo routing's counts
            if reservation is not None:
                reservation.release()
            charge.refund()
            if events is not None:
                ctx.mux.unsubscribe(msg.model, job.qid, events)
            raise


def shared_queue_full(model: str, bound: int) -> APIError:
    return APIError(
        429,
        f"'{model}' has {bound} requests waiting for a worker (the limit); retry shortly.",
        code="overloaded",
        headers={"Retry-After": "2"},
    )
