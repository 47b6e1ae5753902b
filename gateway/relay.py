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

An `EventChannel` is what a request handler reads. It is on the TTFT and per-token path, so it is leaner
than `asyncio.Queue` behind `asyncio.wait_for` (which wraps every wait in a new Task): an event that has
already arrived is returned without suspending, and a wait costs one future and one timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from loragate import keys
from loragate.messages import OutputEvent
from loragate.redis_url import connect_async_single

log = logging.getLogger("loragate.gateway")


class ClientGone(Exception):
    """The client of this channel's request disconnected."""


class EventChannel:
    """One request's output events, in order: the relay puts, the request's handler gets."""

    __slots__ = ("_events", "_gone", "_waiter", "last_id")

    def __init__(self, last_id: str = "0"):
        self.last_id = last_id  # the stream entry id read last
        self._events: deque[OutputEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._gone = False

    def put(self, event: OutputEvent) -> None:
        self._events.append(event)
        self._wake()

    def client_gone(self) -> None:
        """Make the pending and every later `get` raise `ClientGone`."""
        self._gone = True
        self._wake()

    @property
    def gone(self) -> bool:
        """Whether the client of this channel's request disconnected."""
        return self._gone

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __len__(self) -> int:
        return len(self._events)

    async def get(self, timeout: float) -> OutputEvent:
        """The next event; `TimeoutError` if none comes within `timeout` seconds. Events that arrived
        before the client left are still handed out (the last of them may finish the request); then
        `ClientGone`."""
        if not self._events and not self._gone:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self._events:
            return self._events.popleft()
        if self._gone:
            raise ClientGone()
        raise TimeoutError()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _entry_id(raw: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq", or "0") as a comparable pair."""
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


class OutputMux:
    def __init__(self, redis_url: str, control: aioredis.Redis, block_ms: int = 1000, batch: int = 256):
        self._reader = connect_async_single(redis_url)
        self._control = control
        self.block_ms, self.batch = block_ms, batch
        self.subs: dict[str, list[EventChannel]] = {}  # output stream key -> the channels relaying it
        self._wake = asyncio.Event()
        self._reader_id: int | None = None
        self._blocked = False
        self._unblocking = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._reader_id = int(await self._reader.client_id())
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._reader.aclose()

    async def subscribe(
        self, request_id: str, from_id: str = "0", pipe: Pipeline | None = None
    ) -> EventChannel:
        """Relay `lg:out:{request_id}` from after `from_id` to a new channel. With `pipe`, the reader's
        wake-up goes out with that pipeline (queue the request on it after this call)."""
        channel = EventChannel(from_id)
        await self.resume(request_id, channel, pipe)
        return channel

    async def resume(self, request_id: str, channel: EventChannel, pipe: Pipeline | None = None) -> None:
        """Relay to `channel` again, from after its `last_id` (it was dropped after a last event).
        Without `pipe` the wake-up is awaited here; if that fails or is cancelled, the channel is not
        left subscribed."""
        key = keys.output(request_id)
        self.subs.setdefault(key, []).append(channel)
        self._wake.set()
        if self._blocked and not self._unblocking and self._reader_id is not None:
            self._unblocking = True  # one unblock per pending read, however many streams open meanwhile
            if pipe is not None:
                pipe.execute_command("CLIENT", "UNBLOCK", self._reader_id)
                return
            try:
                await self._control.execute_command("CLIENT", "UNBLOCK", self._reader_id)
            except BaseException:
                self._unblocking = False
                self.unsubscribe(request_id, channel)
                raise

    def unsubscribe(self, request_id: str, channel: EventChannel) -> None:
        """Stop relaying to `channel` (other channels of the same request keep theirs)."""
        key = keys.output(request_id)
        channels = self.subs.get(key)
        if channels is not None and channel in channels:
            channels.remove(channel)
            if not channels:
                del self.subs[key]

    def _positions(self) -> dict[str, str]:
        """Where to read each stream from: the earliest position of its channels."""
        return {
            k: cs[0].last_id if len(cs) == 1 else min((c.last_id for c in cs), key=_entry_id)
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
                event = OutputEvent.from_json(fields[b"e"])
                position = _entry_id(entry_id) if len(channels) > 1 else None
                for channel in list(channels):
                    if position is not None and position <= _entry_id(channel.last_id):
                        continue  # this channel started later in the stream
                    channel.last_id = entry_id
                    channel.put(event)
                    if event.is_last:
                        channels.remove(channel)
                if not channels:
                    self.subs.pop(name, None)
                    break

    async def _loop(self) -> None:
        while True:
            if not self.subs:
                self._wake.clear()
                await self._wake.wait()
            streams = self._positions()
            self._blocked, self._unblocking = True, False
            try:
                reply = await self._reader.xread(streams, count=self.batch, block=self.block_ms)
            except Exception:
                log.exception("output relay read failed; retrying")
                await asyncio.sleep(0.1)
                continue
            finally:
                self._blocked = False
            self._dispatch(reply)
