"""What a request handler reads its output events from (`EventChannel`), filled by the output relay
(`gateway.relay`).

A channel is on the TTFT and per-token path, so it is leaner than `asyncio.Queue` behind
`asyncio.wait_for` (which wraps every wait in a new Task): an event that has already arrived is returned
without suspending, and a wait costs one future and one timer. Each event carries the request's cumulative
`completion_tokens`, and a channel drops a token event that does not go past what it has relayed (a worker
writes events again after a Redis restart lost them).
"""

from __future__ import annotations

import asyncio
from collections import deque

from loragate.messages import OutputEvent


class ClientGone(Exception):
    """The client of this channel's request disconnected."""


class EventChannel:
    """One request's output events, in order: the relay puts, the request's handler gets."""

    __slots__ = ("_events", "_gone", "_waiter", "last_id", "tokens")

    def __init__(self, last_id: str = "0"):
        self.last_id = last_id  # the stream entry id read last
        self.tokens = 0  # the request's completion tokens relayed so far
        self._events: deque[OutputEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._gone = False

    def put(self, event: OutputEvent) -> None:
        if event.token_ids:
            if event.completion_tokens <= self.tokens:
                return  # written again after a Redis outage: already relayed
            self.tokens = event.completion_tokens
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


def entry_order(raw: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq", or "0") as a comparable pair."""
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)
