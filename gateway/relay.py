"""One Redis reader for every open response stream of this gateway process.

Thousands of concurrent streams cannot each hold a blocking `XREAD` connection, so a single task runs
`XREAD BLOCK` over all subscribed `lg:out:{id}` keys at once and hands events to per-request queues.
A new subscription must not wait for the current blocking read to time out (that would add up to the
block time to TTFT), so `subscribe` wakes the reader with `CLIENT UNBLOCK` on its connection id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from loragate import keys
from loragate.messages import OutputEvent

log = logging.getLogger("loragate.gateway")


@dataclass
class Subscription:
    last_id: str
    queue: asyncio.Queue[OutputEvent] = field(default_factory=asyncio.Queue)


class OutputMux:
    def __init__(self, redis_url: str, control: aioredis.Redis, block_ms: int = 1000, batch: int = 256):
        self._reader = aioredis.Redis.from_url(redis_url, single_connection_client=True)
        self._control = control
        self.block_ms, self.batch = block_ms, batch
        self.subs: dict[str, Subscription] = {}
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

    async def subscribe(self, request_id: str, from_id: str = "0") -> asyncio.Queue[OutputEvent]:
        sub = Subscription(from_id)
        self.subs[keys.output(request_id)] = sub
        self._wake.set()
        if self._blocked and not self._unblocking and self._reader_id is not None:
            self._unblocking = True  # one unblock per pending read, however many streams open meanwhile
            await self._control.execute_command("CLIENT", "UNBLOCK", self._reader_id)
        return sub.queue

    def unsubscribe(self, request_id: str) -> None:
        self.subs.pop(keys.output(request_id), None)

    async def _loop(self) -> None:
        while True:
            if not self.subs:
                self._wake.clear()
                await self._wake.wait()
            streams = {k: s.last_id for k, s in self.subs.items()}
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
                sub = self.subs.get(key.decode() if isinstance(key, bytes) else key)
                if sub is None:
                    continue
                for entry_id, fields in entries:
                    sub.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    sub.queue.put_nowait(OutputEvent.from_json(fields[b"e"]))
