"""KVEventFollower on a real Redis: every worker's event stream is found and read from its start into the
prefix index, a stream that appears later is picked up, and an entry that does not parse is skipped
without stopping the follower."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from gateway.kv_events import KVEventFollower
from loragate import contracts
from loragate.contracts import AdapterTier, EventType, KVEvent
from policies.prefix_index import PrefixIndex


async def _xadd(r: aioredis.Redis, worker_id: str, *events: KVEvent | str) -> None:
    for event in events:
        raw = event if isinstance(event, str) else event.to_json()
        await r.xadd(contracts.events("tiny", worker_id), {contracts.EVENTS_FIELD: raw})


async def _until(done: Callable[[], bool], timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_follows_every_workers_stream_into_the_index(redis_url: str) -> None:
    async def main() -> tuple[PrefixIndex, KVEventFollower]:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        index = PrefixIndex()
        follower = KVEventFollower(redis_url, r, index, discover_s=0.1)
        try:
            # Written before the follower starts: read from the stream's start.
            await _xadd(r, "w1", KVEvent(EventType.STORED, (1, 2, 3)), KVEvent(EventType.EVICTED, (3,)))
            follower.start()
            await _until(lambda: follower.applied == 2)
            # A worker that appears later, with an adapter event and a malformed entry in between.
            await _xadd(
                r,
                "w2",
                KVEvent(EventType.STORED, (1,)),
                '{"type": "teleported"}',
                KVEvent(EventType.ADAPTER_LOADED, adapter="tiny:a", tier=AdapterTier.DEVICE),
            )
            await _until(lambda: index.resident_adapters("w2") is not None)
            await _xadd(r, "w1", KVEvent(EventType.CLEARED), KVEvent(EventType.STORED, (7,)))
            await _until(lambda: index.cached_blocks("w1", (7,)) == 1)
            return index, follower
        finally:
            await follower.stop()
            await r.aclose()

    index, follower = asyncio.run(main())
    assert index.cached_blocks("w1", (1, 2, 3)) == 0  # cleared
    assert index.cached_blocks("w2", (1, 2)) == 1
    assert index.resident_adapters("w2") == (("tiny:a",), ())
    assert follower.applied == 6  # the malformed entry was skipped, not counted
    assert set(follower.last_ids) == {contracts.events("tiny", "w1"), contracts.events("tiny", "w2")}


def test_no_streams_yet_is_quiet(redis_url: str) -> None:
    async def main() -> KVEventFollower:
        r = aioredis.Redis.from_url(redis_url)  # the follower's own connection reads on a single server
        follower = KVEventFollower(redis_url, r, PrefixIndex(), discover_s=0.05)
        follower.start()
        await asyncio.sleep(0.3)
        await follower.stop()
        await r.aclose()
        return follower

    follower = asyncio.run(main())
    assert (follower.applied, follower.last_ids) == (0, {})
