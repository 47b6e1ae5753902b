"""One Redis reader for every open response stream of this gateway process.

Thousands of concurrent streams cannot each hold a blocking `XREAD` connection, so a single task runs
`XREAD BLOCK` over all subscribed `lg:out:{id}` keys at once and hands events to per-request channels.
A new subscription must not wait for the current blocking read to time out (that would add up to the
block time to TTFT), so `subscribe` wakes the reader with `CLIENT UNBLOCK` on its connection id, sent in
the pipeline that enqueues the request (no round trip of its own). A stream is dropped from the read as
soon as its last event arrives, so a gateway that serves one request at a time never needs an unblock.

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

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __len__(self) -> int:
        return len(self._events)

    async def get(self, timeout: float) -> OutputEvent:
        """The next event; `TimeoutError` if none comes within `timeout` seconds."""
        if not self._events and not self._gone:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self._gone:
            raise ClientGone()
        if not self._events:
            raise TimeoutError()
        return self._events.popleft()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class OutputMux:
    def __init__(self, redis_url: str, control: aioredis.Redis, block_ms: int = 1000, batch: int = 256):
        self._reader = connect_async_single(redis_url)
        self._control = control
        self.block_ms, self.batch = block_ms, batch
        self.subs: dict[str, EventChannel] = {}
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
        """Relay `lg:out:{request_id}` from after `from_id`. With `pipe`, the reader's wake-up goes out
        with that pipeline (queue the request on it after this call)."""
        channel = EventChannel(from_id)
        self.subs[keys.output(request_id)] = channel
        self._wake.set()
        if self._blocked and not self._unblocking and self._reader_id is not None:
            self._unblocking = True  # one unblock per pending read, however many streams open meanwhile
            if pipe is not None:
                pipe.execute_command("CLIENT", "UNBLOCK", self._reader_id)
            else:
                await self._control.execute_command("CLIENT", "UNBLOCK", self._reader_id)
        return channel

    def unsubscribe(self, request_id: str) -> None:
        self.subs.pop(keys.output(request_id), None)

    async def _loop(self) -> None:
        while True:
            if not self.subs:
                self._wake.clear()
                await self._wake.wait()
            streams = {k: c.last_id for k, c in self.subs.items()}
            self._blocked, self._unblocking = True, False
            try:
                reply = await self._reader.xread(streams, count=self.batch, block=self.block_ms)
            except Exception:
                log.exception("output relay read failed; retrying")
                await asyncio.sleep(0.1)
                continue
            finally:
                self._blocked = False
            for key, entries in reply or []:
                name = key.decode() if isinstance(key, bytes) else key
                channel = self.subs.get(name)
                if channel is None:
                    continue
                for entry_id, fields in entries:
                    channel.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    event = OutputEvent.from_json(fields[b"e"])
                    channel.put(event)
                    if event.is_last:  # nothing follows: stop reading the stream now
                        self.subs.pop(name, None)
                        break
