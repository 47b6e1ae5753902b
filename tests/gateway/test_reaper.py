"""The reaper deletes an abandoned (empty, heartbeat-less) queue, but never the queue of a worker that is
starting up: a worker beats before it makes its queue, and the deletion checks the beat atomically. With
no live worker for a dead worker's entry, it moves it to the model's shared stream if that is on."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway.fleet import Fleet
from gateway.reaper import Reaper
from loragate import contracts
from loragate.messages import QueuedRequest
from loragate.types import SamplingParams


def drain_queue_of(redis_url: str, worker_id: str, beating: bool) -> bool:
    """Whether the empty queue of `worker_id` survives a reaper pass over it."""

    async def main() -> bool:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
        try:
            queue = contracts.queue("tiny", worker_id)
            await r.xgroup_create(queue, contracts.WORKER_GROUP, id="0", mkstream=True)
            if beating:  # the heartbeat arrived after the reaper's fleet snapshot was taken
                await r.set(contracts.worker_state("tiny", worker_id), "{}", ex=3)
            reaper = Reaper(r, Fleet(r), "reaper-test")  # its fleet view has no worker at all
            assert await reaper._drain(queue) == 0
            return bool(await r.exists(queue))
        finally:
            await r.aclose()

    return asyncio.run(main())


def test_an_abandoned_empty_queue_is_deleted(redis_url: str) -> None:
    assert drain_queue_of(redis_url, "gone", beating=False) is False


def test_the_queue_of_a_worker_with_a_heartbeat_is_kept(redis_url: str) -> None:
    assert drain_queue_of(redis_url, "starting", beating=True) is True


def reap_with_no_worker(redis_url: str, shared_queue: bool) -> tuple[int, int, bytes | None]:
    """A dead worker's read-but-unacknowledged entry, reaped with no live worker of its model: (entries
    left on the dead queue, entries on the model's shared stream, the queue the request's record names)."""

    async def main() -> tuple[int, int, bytes | None]:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
        try:
            dead, shared = contracts.queue("tiny", "dead"), contracts.model_queue("tiny")
            await r.delete(dead, shared)
            await r.xgroup_create(dead, contracts.WORKER_GROUP, id="0", mkstream=True)
            msg = QueuedRequest("orphan", "tiny", (5, 6, 7), SamplingParams(max_tokens=3))
            entry = await r.xadd(dead, {contracts.QUEUE_FIELD: msg.to_json()})
            record = contracts.request_record("tiny", msg.request_id)
            await r.hset(record, mapping={contracts.RECORD_QUEUE: dead, contracts.RECORD_ENTRY: entry})
            await r.xreadgroup(contracts.WORKER_GROUP, "dead", {dead: ">"})  # it held it, then died
            reaper = Reaper(r, Fleet(r), "reaper-test", shared_queue=shared_queue)
            await reaper._drain(dead)
            queued = await r.exists(shared) and await r.xlen(shared)
            return await r.xlen(dead), int(queued), await r.hget(record, contracts.RECORD_QUEUE)
        finally:
            await r.aclose()

    return asyncio.run(main())


def test_with_the_shared_stream_on_a_dead_workers_entry_waits_there_for_a_worker(redis_url: str) -> None:
    assert reap_with_no_worker(redis_url, shared_queue=True) == (0, 1, contracts.model_queue("tiny").encode())


def test_without_it_the_entry_stays_on_the_dead_queue_until_a_worker_lives(redis_url: str) -> None:
    assert reap_with_no_worker(redis_url, shared_queue=False) == (
        1,
        0,
        contracts.queue("tiny", "dead").encode(),
    )
