"""A handler's output reader on a real Redis: it releases its reservation once however it ends, a
cancel drops a request no worker has read, and an abort read while its client is still there queues
the request again on the least-loaded worker, taking the reservation along."""

from __future__ import annotations

import asyncio

import pytest

from gateway.context import GatewayContext
from gateway.pipeline.admit import Charge
from gateway.pipeline.enqueue import attach, enqueue
from gateway.pipeline.output import OutputReader
from gateway.pipeline.route import route, route_input
from loragate import contracts
from loragate.messages import OutputEvent
from policies.routing_state import Phase
from tests.gateway.pipeline.live_context import BASE, TENANT, WORKERS, job, prompt, put, resolved, run


async def queued(ctx: GatewayContext, request_id: str = "req-00000001") -> OutputReader:
    j = job(ctx, request_id)
    charge = Charge(ctx.admission, TENANT, BASE, 1.0)
    decision, reservation = route(ctx, route_input(j, resolved(ctx), prompt(40)), charge)
    return await enqueue(ctx, j, decision, reservation, charge)


async def aborted_then(
    ctx: GatewayContext, reader: OutputReader, text: str, queue: str | None
) -> OutputEvent:
    """The worker aborts the request; once it is queued again (on `queue`, or anywhere), it ends with
    `text`. Returns what the reader reads."""
    await put(ctx.redis, reader.job.qid, OutputEvent(finish_reason="abort"))
    reading = asyncio.ensure_future(reader.next(5))
    queues = [queue] if queue else [contracts.queue(BASE, w) for w in WORKERS]
    while not any([await ctx.redis.xlen(q) for q in queues]):
        await asyncio.sleep(0.01)
    await put(ctx.redis, reader.job.qid, OutputEvent(text=text, finish_reason="stop"))
    return await reading


def load(ctx: GatewayContext) -> dict[str, int]:
    return {w: v.queue_len for w, v in ctx.fleet.workers.items()}


@pytest.mark.parametrize(
    "ends", [["finish"], ["finish", "finish"], ["cancel"], ["finish", "cancel"], ["cancel", "cancel"]]
)
def test_every_end_releases_once(ends: list[str], redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        other = await queued(ctx, "req-other-01")  # a second request holds its own reservation
        reader = await queued(ctx)
        assert sum(load(ctx).values()) == 2
        for end in ends:
            reader.finish() if end == "finish" else await reader.cancel()
        assert sum(load(ctx).values()) == 1
        assert other.reservation is not None and other.reservation.phase is Phase.QUEUED

    run(redis_url, body)


def test_a_cancel_drops_a_request_no_worker_has_read(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader = await queued(ctx)
        assert reader.reservation is not None
        queue = contracts.queue(BASE, reader.reservation.worker_id)
        assert await ctx.redis.xlen(queue) == 1
        await reader.cancel()
        assert await ctx.redis.xlen(queue) == 0

    run(redis_url, body)


@pytest.mark.parametrize("first_token", [False, True], ids=["before its first token", "after it"])
def test_an_abort_continues_on_the_least_loaded_worker(first_token: bool, redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader = await queued(ctx)
        reservation = reader.reservation
        assert reservation is not None
        before, other = reservation.worker_id, next(w for w in WORKERS if w != reservation.worker_id)
        if first_token:
            reader.first_token()
        event = await aborted_then(ctx, reader, "go on", contracts.queue(BASE, other))
        assert event.text == "go on" and reader.continued == 1
        assert reader.reservation is reservation and reservation.worker_id == other
        assert load(ctx) == {before: 0, other: 1}
        assert ctx.router.state.queued_tokens == ({} if first_token else {other: 40})
        assert await ctx.redis.xlen(contracts.queue(BASE, other)) == 1
        reader.finish()
        assert load(ctx) == {before: 0, other: 0} and ctx.router.state.queued_tokens == {}

    run(redis_url, body)


def test_a_retry_that_continues_the_request_reserves_its_new_worker(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        first = await queued(ctx)
        first.finish()  # its handler left (its client went away): the request is still queued
        retry = await attach(ctx, job(ctx), BASE)
        assert first.reservation is not None
        queue = contracts.queue(BASE, first.reservation.worker_id)
        await ctx.redis.delete(queue)  # the worker wrote the abort and dropped the entry
        assert (await aborted_then(ctx, retry, "on", None)).text == "on"
        assert retry.reservation is not None and retry.reservation.phase is Phase.QUEUED
        assert sum(load(ctx).values()) == 1 and ctx.router.state.queued_tokens == {}
        retry.finish()
        assert sum(load(ctx).values()) == 0

    run(redis_url, body)
