"""The reaper deletes an abandoned (empty, heartbeat-less) queue, but never the queue of a worker that is
starting up: a worker beats before it makes its queue, and the deletion checks the beat atomically."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway.fleet import Fleet
from gateway.reaper import Reaper
from loragate import contracts


def drain_queue_of(redis_url: str, worker_id: str, beating: bool) -> bool:
    """Whether the empty queue of `worker_id` survives a reaper pass over it."""

    async def main() -> bool:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
        try:
            queue = contracts.queue(worker_id)
            await r.xgroup_create(queue, contracts.WORKER_GROUP, id="0", mkstream=True)
            if beating:  # the heartbeat arrived after the reaper's fleet snapshot was taken
                await r.set(contracts.worker_state(worker_id), "{}", ex=3)
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
