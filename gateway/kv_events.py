"""Follow every worker's KV/adapter event stream (`lg:events:{model}:worker`) into the routing prefix index.

One task: it rediscovers the event streams every few seconds and `XREAD`s all of them at once (on its own
connection, blocking). On Redis Cluster one `XREAD` reads one slot, i.e. one base model's workers: it reads
each model's streams through the cluster client, without blocking, and pauses `idle_s` when none had news.
A new stream is read from its start (streams are capped), so a restarted gateway rebuilds its index from what
the workers still hold; a worker's `cleared` event (sent when it starts) drops its old entries. Through a
Redis outage it retries with backoff; a worker that comes back sends `cleared` and then everything its
cache holds, so the index is right again even if Redis restarted without the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis

from loragate import contracts
from loragate.contracts import KVEvent
from loragate.redis_retry import Backoff, OutageLog, is_outage
from loragate.redis_url import connect_async_single, is_cluster
from policies.prefix_index import PrefixIndex

log = logging.getLogger("loragate.gateway")


class KVEventFollower:
    def __init__(
        self,
        redis_url: str,
        shared: aioredis.Redis,
        index: PrefixIndex,
        discover_s: float = 2.0,
        idle_s: float = 0.05,
    ):
        self.cluster = is_cluster(redis_url)
        # Its own blocking connection on one server; the shared cluster client (not closed here) on a cluster.
        self.redis: aioredis.Redis = shared if self.cluster else connect_async_single(redis_url)
        self.index, self.discover_s, self.idle_s = index, discover_s, idle_s
        self.last_ids: dict[str, str] = {}
        self.applied = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if not self.cluster:
            await self.redis.aclose()

    async def _discover(self) -> None:
        async for raw in self.redis.scan_iter(match=contracts.EVENTS_PATTERN, count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            self.last_ids.setdefault(key, "0")

    async def _loop(self) -> None:
        backoff, outage = Backoff(), OutageLog(log, "KV event follower")
        next_discovery = 0.0
        while True:
            try:
                if time.monotonic() >= next_discovery:
                    await self._discover()
                    next_discovery = time.monotonic() + self.discover_s
                if not self.last_ids:
                    await asyncio.sleep(self.discover_s)
                    continue
                reply = await self._read()
                for raw_key, entries in reply:
                    key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                    _, worker_id = contracts.of_worker_key(key)
                    for entry_id, fields in entries:
                        self.last_ids[key] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                        self.index.apply_event(
                            worker_id, KVEvent.from_json(fields[contracts.EVENTS_FIELD_BYTES])
                        )
                        self.applied += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not is_outage(e):
                    log.exception("KV event follower failed; retrying")
                outage.failed(e)
                await asyncio.sleep(backoff.next())
                continue
            if outage.recovered() is not None:
                backoff.reset()

    async def _read(self) -> list[Any]:
        """New entries of the streams: one blocking read, or on a cluster one read per slot."""
        if not self.cluster:
            return list(await self.redis.xread(dict(self.last_ids), count=1000, block=500) or [])
        slots: dict[str, dict[str, str]] = {}
        for key, last in self.last_ids.items():
            slots.setdefault(contracts.tag_of(key), {})[key] = last
        replies = await asyncio.gather(*(self.redis.xread(streams, count=1000) for streams in slots.values()))
        got = [stream for reply in replies for stream in reply or []]
        if not got:
            await asyncio.sleep(self.idle_s)
        return got
