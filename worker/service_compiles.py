"""Guided requests whose grammar compiles off the worker's step thread.

Compiling a new guide takes 1–10 ms for a typical JSON schema and seconds for a big one; done in
`LLMEngine.add_request` on the step thread it would stall every running sequence that long. The intake
(`worker.service_intake`) hands such a request here instead: its guide compiles on a small pool of named
threads (xgrammar releases the GIL meanwhile) while the engine keeps stepping, and the step thread picks
up each finished compile (`finished`) and adds the request to the engine itself — the engine is
single-threaded, and the pool only ever runs the thread-safe compile function. `compiling` holds each
request until the step thread is done with it (`forget`), so a request is never lost between the pool and
the engine; `ready` wakes an idle step thread when a compile ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from loragate.types import Request, SamplingParams

COMPILE_THREADS = 2  # compiles at once: more would only take CPU from the step thread

CompileFn = Callable[[SamplingParams], Any]  # `GuidedDecoding.compile`: params → compiled grammar


@dataclass(frozen=True)
class Compiling:
    request: Request
    future: Future[Any]


class GrammarCompiles:
    def __init__(self, compile_fn: CompileFn, name: str, threads: int = COMPILE_THREADS):
        self.compile_fn = compile_fn
        self.compiling: dict[str, Compiling] = {}  # request id → its compile, until the step thread is done
        self.ready = threading.Event()  # set when a compile ends; cleared by `finished`
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)

    def submit(self, request: Request) -> None:
        """Compile `request`'s guide on the pool."""
        future = self._pool.submit(self.compile_fn, request.params)
        future.add_done_callback(lambda _: self.ready.set())
        self.compiling[request.request_id] = Compiling(request, future)

    def finished(self) -> list[Compiling]:
        """The compiles that have ended (successfully or not), in the order they were submitted; each stays
        in `compiling` until `forget`."""
        self.ready.clear()  # before looking: a compile ending after the look sets it again
        return [c for c in self.compiling.values() if c.future.done()]

    def forget(self, request_id: str) -> bool:
        """Stop tracking the request (started, failed, cancelled or dropped); its compile, if still
        queued, never runs. False if it was not compiling."""
        c = self.compiling.pop(request_id, None)
        if c is None:
            return False
        c.future.cancel()
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.compiling

    def __len__(self) -> int:
        return len(self.compiling)

    def close(self) -> None:
        """Shut the pool down without waiting: queued compiles are dropped, a running one ends on its own
        (its request was never acknowledged, so Redis delivers it again)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
