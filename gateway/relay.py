"""One Redis reader for every open response stream of this gateway process.

Thousands of concurrent streams cannot each hold a blocking `XREAD` connection, so a single task runs
`XREAD BLOCK` over all subscribed `lg:out:{id}` keys at once and hands events to per-request channels.
A new subscription must not wait for the current blocking read to time out (that would add up to the
block time to TTFT), so `subscribe` wakes the reader with `CLIENT UNBLOCK` on its connection id, sent in
the pipeline that enqueues the request (no round trip of its own). A stream is dropped from the read as
soon as its last event arrives, so a gateway that serves one request at a time never needs an unblock.
Several handlers may relay the same stream (a client's retry arrives while the handler of its first try
is still there): each has its own channel and position, the read starts at the earliest of them, and
each channel gets only the entries after its own position.

An `EventChannel` (`gateway.event_channel`) is what a request handler reads.

Redis Cluster: one `XREAD` may only name keys of one slot, and a blocked read and its `CLIENT UNBLOCK` must
be on the same node. `ClusterOutputMux` keeps an `OutputMux` per base model (every output stream of a model
is in its hash tag's slot), each on its own connections to the node that owns that slot.

Redis outages. The reader retries with backoff and, once Redis answers again, takes the new connection's
`CLIENT ID` (for the wake-ups) and looks whether the server restarted. Workers write again the events a
restarted Redis lost (`worker.ledger`), so a channel may see an event twice: each event carries the
request's cumulative `completion_tokens`, and a channel drops a token event that does not go past what it
has relayed. A restarted Redis may also have lost requests that no worker had read yet; once workers had
`RESYNC_GRACE_S` to re-announce what they run, a waiting request that neither has an output stream nor
sits in any queue gets a 503 `queue_unavailable` error event ("retry"), instead of waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from gateway.event_channel import EventChannel, entry_order
from loragate import contracts
from loragate.messages import OutputEvent
from loragate.redis_retry import OUTAGE_ERRORS, RESYNC_GRACE_S, Backoff, OutageLog, is_outage, server_run_id
from loragate.redis_url import connect_async_single

log = logging.getLogger("loragate.gateway")


class OutputMux:
    """The relay of one Redis server (or, on a cluster, of one slot: `queue_patterns` then name that slot's
    queues, and `control` is a client of the node that owns it)."""

    def __init__(
        self,
        redis_url: str,
        control: aioredis.Redis,
        block_ms: int = 1000,
        batch: int = 256,
        queue_patterns: tuple[str, ...] = contracts.queue_patterns(),
        unblock_in_pipe: bool = True,
    ):
        self._reader = connect_async_single(redis_url)
        self._control = control
        # Where `_fail_lost` looks for queued requests; whether a caller's pipeline reaches this server.
        self.queue_patterns, self.unblock_in_pipe = queue_patterns, unblock_in_pipe
        self.block_ms, self.batch = block_ms, batch
        self.subs: dict[str, list[EventChannel]] = {}  # output stream key -> the channels relaying it
        self._wake = asyncio.Event()
        self._reader_id: int | None = None
        self._blocked = False
        self._unblocking = False
        self._task: asyncio.Task[None] | None = None
        self._stale = True  # the reader's connection id (and server) must be read (again)
        self._run_id: str | None = None  # the Redis server process last seen
        self._check: asyncio.Task[None] | None = None
        self.lost = 0  # waiting requests failed because a restarted Redis had lost them
        self.failing = False  # the last read failed (Redis away; on a cluster perhaps the slot moved)

    async def start(self) -> None:
        with contextlib.suppress(*OUTAGE_ERRORS):  # Redis down: the loop connects once it is back
            await self._reconnected()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for task in (self._task, self._check):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._reader.aclose()

    async def _reconnected(self) -> None:
        """Read the (new) connection's id, and after a Redis restart check for lost requests."""
        self._reader_id = int(await self._reader.client_id())
        run_id = server_run_id(await self._reader.info("server"))
        if self._run_id is not None and run_id != self._run_id:  # restarted: count the grace from now
            if self._check is not None:
                self._check.cancel()
            self._check = asyncio.create_task(self._fail_lost())
        self._run_id, self._stale = run_id, False

    async def subscribe(
        self, model: str, request_id: str, from_id: str = "0", pipe: Pipeline | None = None
    ) -> EventChannel:
        """Relay the request's output stream from after `from_id` to a new channel. With `pipe`, the
        reader's wake-up goes out with that pipeline (queue the request on it after this call)."""
        channel = EventChannel(from_id)
        await self.resume(model, request_id, channel, pipe)
        return channel

    async def resume(
        self, model: str, request_id: str, channel: EventChannel, pipe: Pipeline | None = None
    ) -> None:
        """Relay to `channel` again, from after its `last_id` (it was dropped after a last event).
        Without `pipe` the wake-up is awaited here; if that fails or is cancelled, the channel is not
        left subscribed."""
        key = contracts.output(model, request_id)
        self.subs.setdefault(key, []).append(channel)
        self._wake.set()
        if self._blocked and not self._unblocking and self._reader_id is not None:
            self._unblocking = True  # one unblock per pending read, however many streams open meanwhile
            if pipe is not None and self.unblock_in_pipe:
                pipe.execute_command("CLIENT", "UNBLOCK", self._reader_id)
                return
            try:
                await self._control.execute_command("CLIENT", "UNBLOCK", self._reader_id)
            except BaseException:
                self._unblocking = False
                self.unsubscribe(model, request_id, channel)
                raise

    def unsubscribe(self, model: str, request_id: str, channel: EventChannel) -> None:
        """Stop relaying to `channel` (other channels of the same request keep theirs)."""
        key = contracts.output(model, request_id)
        channels = self.subs.get(key)
        if channels is not None and channel in channels:
            channels.remove(channel)
            if not channels:
                del self.subs[key]

    def _positions(self) -> dict[str, str]:
        """Where to read each stream from: the earliest position of its channels."""
        return {
            k: cs[0].last_id if len(cs) == 1 else min((c.last_id for c in cs), key=entry_order)
            for k, cs in self.subs.items()
        }

    def _dispatch(self, reply: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]) -> None:
        """Hand each read entry to every channel of its stream that has not had it yet; a channel is
        dropped after its last event (nothing follows), a stream when no channel is left."""
        for key, entries in reply or []:
            name = key.decode() if isinstance(key, bytes) else key
            channels = self.subs.get(name)
            if not channels:
                continue
            for raw_id, fields in entries:
                entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
                event = OutputEvent.from_json(fields[contracts.OUTPUT_FIELD_BYTES])
                position = entry_order(entry_id) if len(channels) > 1 else None
                for channel in list(channels):
                    if position is not None and position <= entry_order(channel.last_id):
                        continue  # this channel started later in the stream
                    channel.last_id = entry_id
                    channel.put(event)
                    if event.is_last:
                        channels.remove(channel)
                if not channels:
                    self.subs.pop(name, None)
                    break

    async def _loop(self) -> None:
        backoff, outage = Backoff(), OutageLog(log, "output relay")
        while True:
            if not self.subs:
                self._wake.clear()
                await self._wake.wait()
            try:
                if self._stale:
                    await self._reconnected()
                    continue  # streams may have come and gone meanwhile: look again
                # No await between the positions and the read: a stream subscribed after them is not in
                # this read, so its subscribe wakes the read, by this connection's (fresh) id.
                streams = self._positions()
                self._blocked, self._unblocking = True, False
                reply = await self._reader.xread(streams, count=self.batch, block=self.block_ms)
            except Exception as e:
                if not is_outage(e):
                    log.exception("output relay read failed; retrying")
                outage.failed(e)
                self.failing = True
                # The connection's id died with it (a restarted server may give it to another client).
                self._stale, self._reader_id = True, None
                await asyncio.sleep(backoff.next())
                continue
            finally:
                self._blocked = False
            if outage.recovered() is not None:
                backoff.reset()
            self.failing = False
            self._dispatch(reply)

    async def _fail_lost(self) -> None:
        """After a Redis restart: fail the waiting requests that are neither in an output stream nor in a
        queue any more, once workers had time to re-announce theirs (checked twice, a second apart, so a
        request moving between queues is not taken for lost)."""
        await asyncio.sleep(RESYNC_GRACE_S)
        try:
            lost = await self._unknown(list(self.subs))
            if lost:
                await asyncio.sleep(1.0)
                lost = await self._unknown(lost)
        except Exception as e:  # Redis went away again: the next reconnect checks again
            log.warning("could not check for requests lost with Redis: %r", e)
            return
        for key in lost:
            channels = self.subs.pop(key, [])
            for channel in channels:
                channel.put(LOST)
            self.lost += bool(channels)
        if lost:
            log.warning("%d waiting requests were lost when Redis restarted; failed them (503)", len(lost))

    async def _unknown(self, streams: list[str]) -> list[str]:
        """Those of these output streams that do not exist and whose request is in no queue."""
        if not streams:
            return []
        pipe = self._control.pipeline(transaction=False)
        for key in streams:
            pipe.exists(key)
        missing = [key for key, n in zip(streams, await pipe.execute(), strict=True) if not n]
        if not missing:
            return []
        queued: set[str] = set()
        for pattern in self.queue_patterns:
            async for queue in self._control.scan_iter(match=pattern, count=1000):
                for _, fields in await self._control.xrange(queue):
                    msg = json.loads(fields[contracts.QUEUE_FIELD_BYTES])
                    queued.add(contracts.output(msg["model"], msg["request_id"]))
        return [key for key in missing if key not in queued]


LOST = OutputEvent(
    error={
        "message": "The request was lost when the request queue (Redis) restarted without it; please retry.",
        "type": "service_unavailable",
        "code": "queue_unavailable",
        "status": 503,
    }
)
