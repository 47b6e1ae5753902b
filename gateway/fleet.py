"""The gateway's view of the fleet: live workers (unexpired heartbeats) and their outstanding requests.

Refreshed in the background about every half second with one SCAN + MGET + pipelined XLEN; request
handlers read the latest snapshot without touching Redis. A worker deletes a queue entry only when the
request has finished, so the length of its queue stream is its outstanding work — queued in Redis plus
running or waiting in its engine — and, unlike the heartbeat's counters, it is never a second stale.
Each refresh feeds the gateway's `policies.routing_state.RoutingState`, which adds this gateway's own
changes between refreshes (+1 for each request it enqueues, −1 for each of its requests that ends), so
a burst of short requests does not look like a growing queue until the next refresh (which would make
admission hold requests back for up to a refresh interval).

After a Redis outage (or restart) the heartbeats may be gone while their workers, which survived it, are
still reconnecting. For `RESYNC_GRACE_S` after Redis is back (`recovering`), a worker that was live before
is still counted: requests that wait on it are not failed with "no worker", new ones may queue for it,
and the reaper leaves its queue alone. A worker that does not return within the grace drops out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis

from loragate import contracts
from loragate.messages import WorkerState
from loragate.redis_retry import (
    RESYNC_GRACE_S,
    Backoff,
    OutageLog,
    fleet_server_info,
    is_outage,
    server_run_id,
)
from policies.routing_state import RoutingState, WorkerView

log = logging.getLogger("loragate.gateway")

__all__ = ["Fleet", "WorkerView"]


class Fleet:
    def __init__(self, r: aioredis.Redis, interval_s: float = 0.5, state: RoutingState | None = None):
        self.redis, self.interval_s = r, interval_s
        self.state = state if state is not None else RoutingState()
        self._task: asyncio.Task[None] | None = None
        self.refreshed = asyncio.Event()
        self._run_id: str | None = None  # the Redis server process seen last
        self._down = False  # a refresh failed since the last one that worked
        self._grace_until = 0.0  # monotonic: until then, workers seen before an outage still count

    @property
    def workers(self) -> dict[str, WorkerView]:
        """The latest snapshot, with this gateway's changes since (the routing state's view)."""
        return self.state.workers

    @workers.setter
    def workers(self, views: dict[str, WorkerView]) -> None:
        self.state.workers = views

    @property
    def recovering(self) -> bool:
        """Redis came back (or restarted) less than `RESYNC_GRACE_S` ago: workers may not have
        re-announced themselves yet."""
        return time.monotonic() < self._grace_until

    async def refresh(self) -> None:
        try:
            info = await fleet_server_info(self.redis)
        except Exception as e:
            self._down = self._down or is_outage(e)
            raise
        run_id, now = server_run_id(info), time.monotonic()
        if self._down or (self._run_id is not None and run_id != self._run_id):
            self._grace_until = now + RESYNC_GRACE_S
        # A server that (re)started moments ago, whether or not this gateway saw it go.
        uptime = float(info.get("uptime_in_seconds", RESYNC_GRACE_S))
        self._grace_until = max(self._grace_until, now + RESYNC_GRACE_S - uptime)
        self._down, self._run_id = False, run_id
        try:
            await self._read()
        except Exception as e:
            self._down = is_outage(e)
            raise

    async def _read(self) -> None:
        mark = self.state.mark()  # changes made while this awaits Redis may be missing from its lengths
        names = [k async for k in self.redis.scan_iter(match=contracts.WORKER_STATE_PATTERN, count=1000)]
        views: dict[str, WorkerView] = {}
        if names:
            # Each heartbeat with its queue's length (a pipeline, not MGET: on a cluster they span slots).
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
                pipe.xlen(contracts.queue(*contracts.of_worker_key(_text(name))))
            replies = await pipe.execute()
            for raw, length in zip(replies[::2], replies[1::2], strict=True):
                if raw is not None:
                    s = WorkerState.from_json(raw)
                    views[s.worker_id] = WorkerView(s, int(length))
        # While recovering, workers seen before the outage are still re-announcing, presumably.
        self.state.observe(views, mark, keep_missing=self.recovering)
        self.refreshed.set()

    async def _loop(self) -> None:
        backoff, outage = Backoff(), OutageLog(log, "fleet view")
        while True:
            try:
                await self.refresh()
            except Exception as e:  # keep the last snapshot; Redis may be restarting
                if not is_outage(e):
                    log.exception("fleet refresh failed")
                outage.failed(e)
                await asyncio.sleep(min(backoff.next(), self.interval_s))
                continue
            if outage.recovered() is not None:
                backoff.reset()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def serving(self, model: str) -> list[WorkerView]:
        return self.state.serving(model)

    def models(self) -> dict[str, WorkerState]:
        return self.state.models()


def _text(key: bytes | str) -> str:
    return key.decode() if isinstance(key, bytes) else key
