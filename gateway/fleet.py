"""The gateway's view of the fleet: live workers (unexpired heartbeats) and their outstanding requests.

Refreshed in the background about every half second with one SCAN + MGET + pipelined XLEN; request
handlers read the latest snapshot without touching Redis. A worker deletes a queue entry only when the
request has finished, so the length of its queue stream is its outstanding work — queued in Redis plus
running or waiting in its engine — and, unlike the heartbeat's counters, it is never a second stale.
Between refreshes this gateway adds its own changes: +1 for each request it enqueues, −1 for each of its
requests that ends, so a burst of short requests does not look like a growing queue until the next
refresh (which would make admission hold requests back for up to a refresh interval).

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
from dataclasses import dataclass

import redis.asyncio as aioredis

from loragate import contracts
from loragate.messages import WorkerState
from loragate.redis_retry import RESYNC_GRACE_S, Backoff, OutageLog, is_outage, server_run_id

log = logging.getLogger("loragate.gateway")


@dataclass(frozen=True)
class WorkerView:
    state: WorkerState
    queue_len: int  # outstanding requests: entries of lg:q:{worker} (deleted when finished)

    @property
    def load(self) -> int:
        return self.queue_len


class Fleet:
    def __init__(self, r: aioredis.Redis, interval_s: float = 0.5):
        self.redis, self.interval_s = r, interval_s
        self.workers: dict[str, WorkerView] = {}
        self._task: asyncio.Task[None] | None = None
        self.refreshed = asyncio.Event()
        self._delta: dict[str, int] = {}  # this gateway's enqueues minus its ended requests, per worker
        self._run_id: str | None = None  # the Redis server process seen last
        self._down = False  # a refresh failed since the last one that worked
        self._grace_until = 0.0  # monotonic: until then, workers seen before an outage still count

    @property
    def recovering(self) -> bool:
        """Redis came back (or restarted) less than `RESYNC_GRACE_S` ago: workers may not have
        re-announced themselves yet."""
        return time.monotonic() < self._grace_until

    async def refresh(self) -> None:
        try:
            info = await self.redis.info("server")
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
        before = dict(self._delta)
        names = [k async for k in self.redis.scan_iter(match=contracts.WORKER_STATE_PATTERN, count=1000)]
        views: dict[str, WorkerView] = {}
        if names:
            raw = await self.redis.mget(names)
            states = [WorkerState.from_json(v) for v in raw if v is not None]
            pipe = self.redis.pipeline(transaction=False)
            for s in states:
                pipe.xlen(contracts.queue(s.worker_id))
            lengths = await pipe.execute()
            views = {s.worker_id: WorkerView(s, int(n)) for s, n in zip(states, lengths, strict=True)}
        # Changes made while the refresh awaited Redis may be missing from its lengths: keep applying them.
        self._delta = {w: d - before.get(w, 0) for w, d in self._delta.items() if d != before.get(w, 0)}
        for worker_id, d in self._delta.items():
            if (view := views.get(worker_id)) is not None:
                views[worker_id] = WorkerView(view.state, max(0, view.queue_len + d))
        if self.recovering:  # still re-announcing, presumably
            views = {**self.workers, **views}
        self.workers = views
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

    def note_enqueued(self, worker_id: str) -> None:
        """Count a request this gateway just queued, so routing sees it before the next refresh."""
        self._note(worker_id, +1)

    def note_ended(self, worker_id: str) -> None:
        """Uncount a request this gateway queued that has ended (finished, failed or cancelled)."""
        self._note(worker_id, -1)

    def _note(self, worker_id: str, change: int) -> None:
        self._delta[worker_id] = self._delta.get(worker_id, 0) + change
        view = self.workers.get(worker_id)
        if view is not None:
            self.workers[worker_id] = WorkerView(view.state, max(0, view.queue_len + change))

    def serving(self, model: str) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.state.model == model and not w.state.draining]

    def models(self) -> dict[str, WorkerState]:
        """One live worker's state per base model name."""
        out: dict[str, WorkerState] = {}
        for w in self.workers.values():
            out.setdefault(w.state.model, w.state)
        return out
