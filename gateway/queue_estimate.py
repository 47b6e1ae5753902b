"""How long a new request would wait for a worker: requests ahead of it, divided by the rate at which the
model's fleet finishes requests, taken at a high quantile. Pure figures from the fleet snapshot and from
what this gateway saw finish; `gateway.overload` decides with them.

Requests ahead. A new request for model m from tenant t waits behind
  * the requests on m's workers that are not running yet: Σ over its live workers of
    max(0, outstanding − slots). Outstanding is the fleet snapshot (kept current between refreshes);
    slots, how many sequences a worker runs at once, is learned from its heartbeats (`WorkerSlots`): the
    `running` it reports while requests wait in it for room, or more if it later runs more with none
    waiting. Requests wait for room when its batch is full (`max_running`) or its KV pool could not take
    one more request of the longest length; otherwise they only wait for their turn at the per-step
    prefill budget (a burst is admitted a few prompts a step) and start within steps, so that heartbeat
    says nothing of the worker's capacity (learning from it refused a burst of 32 on a worker that runs
    32 at once with 429s whose `Retry-After` pushed their TTFTs past 10 s). A worker that does not report
    its capacity is taken as full whenever requests wait in it. A worker never seen full counts no
    backlog: it may well run a sudden burst at once, and its last heartbeat (up to a second old) cannot
    say;
  * the requests that leave this gateway's fair queue before it: the tenant's own queued ones plus, from
    every other waiting tenant u, min(queued_u, queued_t + 1). The fair queue serves backlogged tenants
    in turn, so a tenant that floods waits behind its own backlog, and a light tenant is not refused
    because of somebody else's flood.

Drain rate: requests of m finished per second, the larger of two lower bounds:
  * measured here (`DrainMeter`): requests this gateway saw finish in the last `window_s` seconds divided
    by the window (the gateway's age while it is younger). Idle time in the window can only make it low;
    it matters only when there is a backlog, i.e. while the workers are saturated. An empty window keeps
    the last rate measured, so a burst after a quiet spell is not admitted blind;
  * from the heartbeats: Σ decode_tok_s of m's workers / completion tokens per request (the mean measured
    here; before anything finished, the mean `max_tokens` asked for, an upper bound). It counts the work
    of every gateway sharing the fleet, which the local measure misses.

The estimated wait is a high quantile, not the mean, so that admitted requests, not just the average
one, start within the bound: with k requests ahead, every slot is taken and the request starts at the
(k+1)-th completion; were completions a Poisson stream at the drain rate r, that time would be Gamma
distributed with mean n/r (n = k+1) and standard deviation √n/r, so the estimate is (n + 2√n) / r (about
its 97th percentile; 0 with nothing ahead). It also covers completions that come in bunches (identical
requests started together) and a snapshot one or two requests behind. While neither rate is known
(nothing has finished yet) the estimate is unknown (None).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.fleet import WorkerView
from loragate.messages import WorkerState

TAIL_Z = 2.0  # standard deviations of the wait added to its mean (see the module docstring)


class DrainMeter:
    """Requests of one model finished per second, as this gateway saw them (see the docstring)."""

    def __init__(self, now: float, window_s: float = 10.0):
        self.started, self.window_s = now, window_s
        self._done: deque[tuple[float, int]] = deque()  # (when, completion tokens)
        self._tokens = 0  # completion tokens in the window
        self._last_rate = 0.0
        self._last_tokens: float | None = None
        self._asked: float | None = None  # moving mean of max_tokens asked for

    def asked(self, max_tokens: int) -> None:
        self._asked = max_tokens if self._asked is None else 0.95 * self._asked + 0.05 * max_tokens

    def finished(self, now: float, completion_tokens: int) -> None:
        self._done.append((now, completion_tokens))
        self._tokens += completion_tokens
        self.rate(now)  # keeps the figures of the last window that held anything

    def _expire(self, now: float) -> None:
        while self._done and self._done[0][0] < now - self.window_s:
            self._tokens -= self._done.popleft()[1]

    def rate(self, now: float) -> float:
        """Requests per second; 0.0 while nothing has finished yet."""
        self._expire(now)
        if self._done:
            span = min(self.window_s, max(now - self.started, 1e-3))
            self._last_rate = len(self._done) / span
            self._last_tokens = self._tokens / len(self._done)
        return self._last_rate

    def tokens_per_request(self, now: float) -> float | None:
        self.rate(now)
        return self._last_tokens if self._last_tokens is not None else self._asked


class WorkerSlots:
    """How many sequences each worker runs at once, learned from its heartbeats (see the docstring)."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}

    def observe(self, workers: Iterable[WorkerView]) -> None:
        for w in workers:
            state = w.state
            if state.waiting > 0 and waits_for_room(state):  # full: what it runs is what it can run now
                self.slots[state.worker_id] = state.running
            elif state.worker_id in self.slots:  # it runs more than it did when last full
                self.slots[state.worker_id] = max(self.slots[state.worker_id], state.running)

    def backlog(self, workers: Iterable[WorkerView]) -> int:
        """Requests on these workers that are not running yet (queued in Redis or waiting in an engine)."""
        self.observe(workers)
        return sum(max(0, w.load - self.slots.get(w.state.worker_id, w.load)) for w in workers)


def waits_for_room(state: WorkerState) -> bool:
    """Whether a worker's waiting requests wait for room: its batch is full, or its KV pool has fewer
    free blocks than a request of the longest length takes (True when it does not report these)."""
    if not state.max_running or not state.kv_blocks_total:
        return True
    longest = -(-state.max_model_len // max(1, state.block_size))
    return state.running >= state.max_running or state.kv_blocks_free < longest


def fleet_rate(workers: Iterable[WorkerView], tokens_per_request: float | None) -> float:
    """Requests per second the workers finish by their heartbeats' decode rates; 0.0 when unknown."""
    if not tokens_per_request:
        return 0.0
    return sum(w.state.decode_tok_s for w in workers) / max(1.0, tokens_per_request)


@dataclass(frozen=True)
class Load:
    """What admission sees of one model at one instant."""

    backlog: int  # requests on its workers not running yet
    queued: Mapping[str, int]  # this gateway's fair queue: tenant -> requests waiting
    drain_rps: float  # requests finished per second; 0.0 = unknown

    def ahead(self, tenant: str) -> int:
        """Requests served before a new one of `tenant` (the fair queue's turns, see the docstring)."""
        own = self.queued.get(tenant, 0)
        others = sum(min(n, own + 1) for t, n in self.queued.items() if t != tenant)
        return self.backlog + own + others

    def wait_s(self, tenant: str) -> float | None:
        """Estimated queue wait of a new request (the high quantile of the module docstring); None when the
        drain rate is unknown. With nothing ahead it may find a free slot: 0."""
        if self.drain_rps <= 0:
            return None
        n = self.ahead(tenant) + 1  # it starts when the n-th request from now ends
        return (n + TAIL_Z * math.sqrt(n)) / self.drain_rps if n > 1 else 0.0
