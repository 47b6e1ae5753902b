"""The gateway's fleet view (`gateway.fleet.Fleet`) on a real Redis: one refresh reads every live
heartbeat and its queue's length; draining workers do not serve; and a request this gateway routes while
a refresh is reading Redis is counted once, whether or not the refresh saw its queue entry."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from gateway.fleet import Fleet
from loragate import contracts
from loragate.messages import WorkerState

PREFIX = "fleet-test"  # worker ids of this module (other tests' heartbeats may be live beside them)


def state(worker_id: str, model: str = "tiny", draining: bool = False) -> WorkerState:
    return WorkerState(worker_id, model, "/m", 2048, draining=draining, updated_at=time.time())


def run(redis_url: str, body: Callable[[aioredis.Redis, Fleet], Awaitable[None]]) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            await asyncio.wait_for(body(r, Fleet(r)), 15)
        finally:
            for key in [k async for k in r.scan_iter(match=f"{contracts.PREFIX}:w:*")]:
                await r.delete(key)
            await r.aclose()

    asyncio.run(main())


async def announce(r: aioredis.Redis, s: WorkerState, queued: int = 0) -> None:
    await r.set(contracts.worker_state(s.model, s.worker_id), s.to_json(), ex=60)
    await r.delete(contracts.queue(s.model, s.worker_id))
    for i in range(queued):
        await r.xadd(contracts.queue(s.model, s.worker_id), {contracts.QUEUE_FIELD: f"{i}"})


def test_a_refresh_reads_heartbeats_and_queue_lengths(redis_url: str) -> None:
    async def body(r: aioredis.Redis, fleet: Fleet) -> None:
        await announce(r, state(f"{PREFIX}-a"), queued=3)
        await announce(r, state(f"{PREFIX}-b", draining=True), queued=1)
        await announce(r, state(f"{PREFIX}-c", model="other"))
        await r.xadd(contracts.queue("tiny", f"{PREFIX}-gone"), {contracts.QUEUE_FIELD: "x"})  # no heartbeat
        await fleet.refresh()
        assert {w: v.queue_len for w, v in fleet.workers.items() if w.startswith(PREFIX)} == {
            f"{PREFIX}-a": 3,
            f"{PREFIX}-b": 1,
            f"{PREFIX}-c": 0,
        }
        ours = [w.state.worker_id for w in fleet.serving("tiny") if w.state.worker_id.startswith(PREFIX)]
        assert ours == [f"{PREFIX}-a"]  # b drains
        assert {"tiny", "other"} <= set(fleet.models())

    run(redis_url, body)


def test_a_request_routed_while_a_refresh_reads_redis_is_counted_once(redis_url: str) -> None:
    """The refresh has read the queue lengths when this gateway queues (and notes) a request: the
    refresh's lengths miss it, so the noted change is kept on top; the next refresh sees the entry and
    drops the note. Either way the worker counts it exactly once."""

    async def body(r: aioredis.Redis, fleet: Fleet) -> None:
        worker = f"{PREFIX}-a"
        await announce(r, state(worker), queued=1)
        await fleet.refresh()
        assert fleet.workers[worker].queue_len == 1
        read_lengths = fleet.redis.pipeline

        def pipeline(transaction: bool = True) -> object:  # the refresh's XLEN pipeline
            pipe = read_lengths(transaction=transaction)
            execute = pipe.execute

            async def execute_then_route() -> list[object]:
                lengths = await execute()
                fleet.state.note_enqueued(worker)  # routed meanwhile; its entry is not in `lengths`
                return list(lengths)

            pipe.execute = execute_then_route  # type: ignore[method-assign]
            return pipe

        fleet.redis.pipeline = pipeline  # type: ignore[method-assign]
        await fleet.refresh()
        fleet.redis.pipeline = read_lengths  # type: ignore[method-assign]
        assert fleet.workers[worker].queue_len == 2
        await r.xadd(contracts.queue("tiny", worker), {contracts.QUEUE_FIELD: "routed"})  # its entry lands
        await fleet.refresh()
        assert fleet.workers[worker].queue_len == 2
        fleet.state.note_ended(worker)  # it ends here before its entry is deleted
        assert fleet.workers[worker].queue_len == 1

    run(redis_url, body)


def test_between_refreshes_this_gateways_changes_apply_at_once(redis_url: str) -> None:
    async def body(r: aioredis.Redis, fleet: Fleet) -> None:
        worker = f"{PREFIX}-a"
        await announce(r, state(worker))
        await fleet.refresh()
        fleet.state.note_enqueued(worker)
        fleet.state.note_enqueued(worker)
        assert fleet.workers[worker].queue_len == 2
        fleet.state.note_ended(worker)
        fleet.state.note_ended(worker)
        fleet.state.note_ended(worker)  # never below zero
        assert fleet.workers[worker].queue_len == 0
        assert dataclasses.asdict(fleet.workers[worker].state)["worker_id"] == worker

    run(redis_url, body)
