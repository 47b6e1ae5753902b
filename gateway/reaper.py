"""Nothing is lost when a worker dies: its queue is taken over and re-routed.

About every second, each queue stream `lg:q:{worker}` whose worker has no live heartbeat is drained by
this gateway: entries the dead worker had read but not acknowledged are claimed (`XAUTOCLAIM`), entries it
never read are read through the consumer group, and each is re-enqueued on a live worker serving the same
base model — with the tokens its output stream already holds as `resume_token_ids`, so the client's
stream continues where it stopped — and only then acknowledged and deleted from the dead queue. Claims
are atomic, so several gateways can reap side by side. An entry with no live worker to take it stays
claimed and is retried on the next pass — or, with the model's shared stream on (`model_queue_max`), is
moved there, where the next worker of that model to start takes it.

Right after a Redis outage or restart every heartbeat may have expired while the workers live on and are
reconnecting; taking their queues then would run their requests twice. So nothing is reaped while the
fleet view is `recovering` (`RESYNC_GRACE_S` after Redis came back).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import redis.asyncio as aioredis

from gateway.fleet import Fleet, WorkerView
from loragate import contracts, request_record
from loragate.messages import QueuedRequest, streamed_so_far
from loragate.redis_retry import Backoff, OutageLog, is_outage

log = logging.getLogger("loragate.gateway")

_DELETE_IF_ABANDONED = """
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('XLEN', KEYS[1]) == 0 then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


async def ensure_group(r: aioredis.Redis, stream: str) -> None:
    """`stream` and its consumer group `workers`, made if missing."""
    try:
        await r.xgroup_create(stream, contracts.WORKER_GROUP, id="0", mkstream=True)
    except aioredis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def least_loaded(fleet: Fleet, base: str) -> WorkerView | None:
    """Re-routed work was already admitted, so no queue bound applies: the least-loaded live worker."""
    serving = fleet.serving(base)
    return min(serving, key=lambda w: (w.load, w.state.worker_id)) if serving else None


class Reaper:
    def __init__(
        self,
        r: aioredis.Redis,
        fleet: Fleet,
        consumer: str,
        interval_s: float = 1.0,
        shared_queue: bool = False,
    ):
        self.redis, self.fleet, self.consumer = r, fleet, consumer
        self.shared_queue = shared_queue  # no live worker for an entry: onto its model's shared stream
        self.interval_s = interval_s
        self.rerouted = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        backoff, outage = Backoff(), OutageLog(log, "reaper")
        delay = self.interval_s
        while True:
            await asyncio.sleep(delay)
            try:
                await self.sweep()
            except Exception as e:
                if not is_outage(e):
                    log.exception("reaper pass failed")
                outage.failed(e)
                delay = max(self.interval_s, backoff.next())
                continue
            if outage.recovered() is not None:
                backoff.reset()
            delay = self.interval_s

    async def sweep(self) -> int:
        await self.fleet.refresh()
        if self.fleet.recovering:  # workers may still be re-announcing themselves
            return 0
        moved = 0
        async for raw_key in self.redis.scan_iter(match=contracts.QUEUE_PATTERN, count=1000):
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            if contracts.of_worker_key(key)[1] not in self.fleet.workers:
                moved += await self._drain(key)
        self.rerouted += moved
        return moved

    async def _drain(self, queue: str) -> int:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        try:
            _, claimed, *_ = await self.redis.xautoclaim(
                queue, contracts.WORKER_GROUP, self.consumer, 0, "0-0", count=1000
            )
            entries.extend(claimed)
            fresh = await self.redis.xreadgroup(
                contracts.WORKER_GROUP, self.consumer, {queue: ">"}, count=1000
            )
        except aioredis.ResponseError as e:
            if "NOGROUP" in str(e):
                return 0
            raise
        for _, items in fresh or []:
            entries.extend(items)
        moved = 0
        for entry_id, fields in entries:
            if fields is None:  # deleted meanwhile
                continue
            if await self._reroute(
                queue, entry_id, QueuedRequest.from_json(fields[contracts.QUEUE_FIELD_BYTES])
            ):
                moved += 1
        if not entries:
            # Atomically: only while the queue is empty and its worker still has no heartbeat (a starting
            # worker beats before it makes its queue).
            state = contracts.worker_state(*contracts.of_worker_key(queue))
            await self.redis.eval(_DELETE_IF_ABANDONED, 2, queue, state)
        return moved

    async def _reroute(self, queue: str, entry_id: bytes, msg: QueuedRequest) -> bool:
        streamed, _, done = streamed_so_far(
            await self.redis.xrange(contracts.output(msg.model, msg.request_id))
        )
        if done:  # only its ack was lost
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(queue, contracts.WORKER_GROUP, entry_id)
            pipe.xdel(queue, entry_id)
            await pipe.execute()
            return False
        worker = least_loaded(self.fleet, msg.model)
        if worker is None and not self.shared_queue:
            return False  # no live worker for this model yet: retry next pass
        moved = dataclasses.replace(msg, attempt=msg.attempt + 1, resume_token_ids=tuple(streamed))
        if worker is None:  # it waits on the model's shared stream for the next worker to start
            target = contracts.model_queue(msg.model)
            await ensure_group(self.redis, target)
        else:
            target = contracts.queue(msg.model, worker.state.worker_id)
        # One script: queue the copy, point the request's record at it, drop the old entry — only if the
        # old entry is still there, so a retried call (its reply lost) or another reaper adds no second copy.
        entry = await self.redis.eval(
            request_record.MOVE,
            3,
            queue,
            target,
            contracts.request_record(msg.model, msg.request_id),
            entry_id,
            moved.to_json(),
            contracts.WORKER_GROUP,
        )
        if entry is None:
            return False
        if worker is not None:  # no handler owns it: counted until refresh
            self.fleet.state.note_enqueued(worker.state.worker_id)
        log.info("re-routed %s from %s to %s after %d tokens", msg.request_id, queue, target, len(streamed))
        return True
