"""A step's writes, sent while the engine computes the next step.

Each step ends with writes: every request's output event on `lg:out:{id}`, the acks of requests whose
last event that was, and the previous step's KV events. Sent on the step loop, their round trip (and the
JSON and the protocol packing of a few hundred commands) is time in which the engine computes nothing;
here one thread of its own sends them, as one MULTI pipeline, while the loop goes on with the next step,
whose Python releases the GIL in every torch call. One write is in flight at a time: the loop `settle`s
the last one before it hands over the next, so events reach each stream in step order and a request is
acknowledged only after its last event is stored (the same pipeline, in order).

The events are recorded in the ledger (`worker.ledger`) before they are handed over, so a write that
fails for want of Redis loses nothing: `settle` raises the error on the loop, which pauses stepping and
re-syncs, writing what the server does not hold. What a write retires (its finished requests) is
retired only once `settle` has seen it succeed.

The thread pays where the next step leaves a core to it (`overlap_by_default`): on an accelerator, whose
step the loop only waits for, or on a CPU engine whose threads leave a core free. A CPU engine on every
core would have the thread preempt one of its OpenMP threads, and the whole team wait for that one at the
next barrier: with 2 threads on 2 cores the served worker gave ~10 % fewer tokens a second on ~15 % more
CPU (`python -m loadtest.bench_serve`, two interleaved rounds), so there the loop sends its writes itself,
in one round trip with its read of new requests (`WorkerService._flush`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
import torch

from loragate.contracts import KVEvent
from loragate.messages import OutputEvent
from worker.service_outputs import add_event


def overlap_by_default(device: str) -> bool:
    """Whether a step's writes should go out on their own thread for an engine on `device` (see above)."""
    if device != "cpu":
        return True
    return torch.get_num_threads() < len(os.sched_getaffinity(0))


@dataclass
class StepWrite:
    """What one step hands over: events in step order, then acks (queue entry ids), then KV events."""

    events: list[tuple[str, OutputEvent]] = field(default_factory=list)  # (request id, event)
    finished: list[str] = field(default_factory=list)  # requests whose last event is among `events`
    acks: list[str] = field(default_factory=list)
    kv: list[KVEvent] = field(default_factory=list)
    tokens: int = 0  # tokens the events carry (the decode rate the heartbeat reports)

    def __bool__(self) -> bool:
        return bool(self.events or self.acks or self.kv)


AddAcks = Callable[[redis.client.Pipeline, list[str]], None]
AddKV = Callable[[redis.client.Pipeline, list[KVEvent]], None]


class StepWriter:
    """Puts a `StepWrite` on a pipeline (`add`) and, with `overlap`, sends one at a time on a thread of its
    own (`submit`, then `settle`); without, the caller sends its pipeline itself."""

    def __init__(self, r: redis.Redis, model: str, add_acks: AddAcks, add_kv: AddKV, overlap: bool):
        self.redis, self.model, self.overlap = r, model, overlap
        self._add_acks, self._add_kv = add_acks, add_kv
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="step-writes") if overlap else None
        self._pending: tuple[StepWrite, Future[None]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def add(self, pipe: redis.client.Pipeline, write: StepWrite) -> int:
        """`write`'s commands on `pipe`, in order; returns how many."""
        before = len(pipe.command_stack)
        for request_id, event in write.events:
            add_event(pipe, self.model, request_id, event)
        self._add_acks(pipe, write.acks)
        self._add_kv(pipe, write.kv)
        return len(pipe.command_stack) - before

    def submit(self, write: StepWrite) -> None:
        """Send `write` on the thread (the last one must be settled)."""
        assert self._pool is not None and self._pending is None, "settle the last write first"
        self._pending = (write, self._pool.submit(self._send, write))

    def settle(self) -> StepWrite | None:
        """Wait for the write in flight; returns it once written (None if there was none), or raises
        its error (the write is dropped: the ledger still holds its events)."""
        if self._pending is None:
            return None
        write, future = self._pending
        self._pending = None
        future.result()
        return write

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _send(self, write: StepWrite) -> None:
        pipe = self.redis.pipeline(transaction=True)  # MULTI: an event refused (e.g. OOM) aborts its ack too
        self.add(pipe, write)
        raise_write_errors(pipe.execute(raise_on_error=False))


def raise_write_errors(replies: list[object]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
