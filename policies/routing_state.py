"""One router's routing state: the fleet as last observed plus its own changes since, and what its
in-flight requests reserve. Pure Python, no I/O, no torch: the gateway feeds it from Redis
(`gateway.fleet`), the simulator from its simulated heartbeats (`loadtest.simulate`), and both route
through the same `RoutingState.route`, so the simulator measures the code that serves.

The fleet view is each worker's `WorkerState` and its outstanding requests (queued, waiting or running)
as an observation saw them. Between observations this router applies its own changes at once (+1 when
it routes a request to a worker, −1 when one of its requests ends), so a burst of requests does not all
land on one worker before the next observation. An observation that took a while (the gateway's refresh
awaits Redis) may miss the changes made meanwhile: `mark()` before it starts, `observe(views, mark)`
after, and the changes noted since the mark are applied on top of what it saw.

A routed request holds a `Reservation` on its worker: one outstanding request, its prompt tokens in the
worker's `queued_tokens` until its first token (the prefill queued ahead of later requests, the cost
scorer's input), its adapter as pending on the worker until it ends (`Candidate.pending_adapters`: the
worker loads it for this request, so the next request of a burst for it finds it there, not the disk
tier a heartbeat from before the burst reports), and its prefix blocks recorded as routed there in the
`PrefixIndex` (kept: what was sent where is what the worker most likely holds). Its lifecycle is route →
`commit` (queued) → `first_token` → `release`; every transition is idempotent, and `release` gives back
what is still held exactly once, from any phase (success, error, disconnect, a concurrent copy queued
first, Redis failing). `move` follows a request queued again on another worker.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

from loragate.messages import WorkerState
from policies.prefix_index import PrefixIndex
from policies.types import Candidate, RouteDecision, RouteRequest

PROMPT_TEXT_LIMIT = 4000  # characters of the rendered prompt handed to difficulty estimation


@dataclass(frozen=True)
class WorkerView:
    state: WorkerState
    queue_len: int  # outstanding requests: entries of lg:q:{worker} (deleted when finished)

    @property
    def load(self) -> int:
        return self.queue_len


@dataclass(frozen=True)
class ObservationMark:
    """This router's changes per worker when an observation started (see `RoutingState.mark`)."""

    noted: Mapping[str, int]


class RoutingProfile(Protocol):
    """What routes: `policies.framework.Profile`, or anything with its `route`."""

    def route(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random, decision_id: str
    ) -> RouteDecision: ...


class Phase(StrEnum):
    ROUTED = "routed"  # counted on its worker; not known to be queued yet
    QUEUED = "queued"  # on its worker's queue
    PREFILLED = "prefilled"  # its first token came: its prompt no longer waits on the worker
    RELEASED = "released"  # ended: nothing held any more


class Reservation:
    """What one routed request holds on its worker, given back by its lifecycle (module docstring)."""

    def __init__(self, state: RoutingState, worker_id: str, prompt_tokens: int, adapter: str | None = None):
        self._state, self._worker_id, self.prompt_tokens = state, worker_id, prompt_tokens
        self.adapter = adapter
        self._phase = Phase.ROUTED

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def holds_prompt(self) -> bool:
        return self._phase in (Phase.ROUTED, Phase.QUEUED)

    def commit(self) -> None:
        """The request is on its worker's queue."""
        if self._phase is Phase.ROUTED:
            self._phase = Phase.QUEUED

    def first_token(self) -> None:
        """Its first token came back: its prompt no longer waits on the worker."""
        if self.holds_prompt:
            self._state.unqueue_tokens(self._worker_id, self.prompt_tokens)
            self._phase = Phase.PREFILLED

    def release(self) -> bool:
        """It ended (any way): give back what it still holds. True the first time only."""
        if self._phase is Phase.RELEASED:
            return False
        self.first_token()
        self._state.note_ended(self._worker_id)
        self._state.drop_adapter(self._worker_id, self.adapter)
        self._phase = Phase.RELEASED
        return True

    def move(self, worker_id: str) -> None:
        """It was queued again on `worker_id` (continued after an abort): what it holds moves along."""
        if self._phase is Phase.RELEASED or worker_id == self._worker_id:
            return
        self._state.note_ended(self._worker_id)
        self._state.note_enqueued(worker_id)
        self._state.drop_adapter(self._worker_id, self.adapter)
        self._state.hold_adapter(worker_id, self.adapter)
        if self.holds_prompt:
            self._state.unqueue_tokens(self._worker_id, self.prompt_tokens)
            self._state.queue_tokens(worker_id, self.prompt_tokens)
        self._worker_id = worker_id
        if self._phase is Phase.ROUTED:  # queued again means queued
            self._phase = Phase.QUEUED


@dataclass(frozen=True)
class Routed:
    decision: RouteDecision
    reservation: Reservation | None  # None when no worker was chosen
    shadow: RouteDecision | None = None  # the shadow profile's decision on the same candidates


class RoutingState:
    """The fleet view and the reservations of one router (one gateway process, or one simulation).

    Parameters:
        index: the prefix index candidates' `cached_blocks` come from (fed with KV events by its owner).
        count_queued_tokens: tell routing the prompt tokens queued on each worker (else None: unknown).
        record_routed: record each routed request's blocks in the index, not only KV events.
    """

    def __init__(
        self, index: PrefixIndex | None = None, count_queued_tokens: bool = True, record_routed: bool = True
    ):
        self.index = index if index is not None else PrefixIndex()
        self.count_queued_tokens, self.record_routed = count_queued_tokens, record_routed
        self.workers: dict[str, WorkerView] = {}
        self.queued_tokens: dict[str, int] = {}  # prompt tokens routed to a worker, first token not out
        self._delta: dict[str, int] = {}  # this router's routed minus its ended requests, per worker
        # Per worker, the adapters of this router's outstanding requests there, with their counts.
        self._adapters: dict[str, dict[str, int]] = {}

    # -- the fleet view --------------------------------------------------------------------------
    def mark(self) -> ObservationMark:
        """Call when an observation starts; pass the mark to `observe` when it is complete."""
        return ObservationMark(MappingProxyType(dict(self._delta)))

    def observe(
        self, views: Mapping[str, WorkerView], mark: ObservationMark | None = None, keep_missing: bool = False
    ) -> None:
        """Workers as an observation saw them (without `mark`: at this instant). Changes noted since
        `mark` may be missing from it and are applied on top; `keep_missing` keeps workers it did not see.
        One router uses one kind: an observation without a mark forgets every change noted so far, so it
        must not come between a `mark` and the `observe` it belongs to."""
        before = mark.noted if mark is not None else dict(self._delta)
        self._delta = {w: d - before.get(w, 0) for w, d in self._delta.items() if d != before.get(w, 0)}
        fresh = dict(views)
        for worker_id, d in self._delta.items():
            if (view := fresh.get(worker_id)) is not None:
                fresh[worker_id] = WorkerView(view.state, max(0, view.queue_len + d))
        self.workers = {**self.workers, **fresh} if keep_missing else fresh

    def note_enqueued(self, worker_id: str) -> None:
        """Count a request this router queued on `worker_id` (before the next observation sees it)."""
        self._note(worker_id, +1)

    def note_ended(self, worker_id: str) -> None:
        self._note(worker_id, -1)

    def _note(self, worker_id: str, change: int) -> None:
        self._delta[worker_id] = self._delta.get(worker_id, 0) + change
        view = self.workers.get(worker_id)
        if view is not None:
            self.workers[worker_id] = WorkerView(view.state, max(0, view.queue_len + change))

    def hold_adapter(self, worker_id: str, adapter: str | None) -> None:
        if adapter is not None:
            held = self._adapters.setdefault(worker_id, {})
            held[adapter] = held.get(adapter, 0) + 1

    def drop_adapter(self, worker_id: str, adapter: str | None) -> None:
        held = self._adapters.get(worker_id)
        if adapter is None or held is None or adapter not in held:
            return
        held[adapter] -= 1
        if not held[adapter]:
            del held[adapter]
            if not held:
                del self._adapters[worker_id]

    def queue_tokens(self, worker_id: str, tokens: int) -> None:
        if tokens:
            self.queued_tokens[worker_id] = self.queued_tokens.get(worker_id, 0) + tokens

    def unqueue_tokens(self, worker_id: str, tokens: int) -> None:
        if not tokens:
            return
        left = self.queued_tokens.get(worker_id, 0) - tokens
        if left > 0:
            self.queued_tokens[worker_id] = left
        else:
            self.queued_tokens.pop(worker_id, None)

    def serving(self, model: str) -> list[WorkerView]:
        """Live workers of `model` that take new requests (not draining)."""
        return [w for w in self.workers.values() if w.state.model == model and not w.state.draining]

    def models(self) -> dict[str, WorkerState]:
        """One live worker's state per base model name."""
        out: dict[str, WorkerState] = {}
        for w in self.workers.values():
            out.setdefault(w.state.model, w.state)
        return out

    # -- routing ---------------------------------------------------------------------------------
    def candidates(self, base: str | None, hashes: Sequence[int] = ()) -> list[Candidate]:
        """Every worker of `base` (None: of any model) as routing sees it, in worker-id order for a base."""
        if base is None:
            return [self._candidate(w, hashes) for w in self.workers]
        ids = sorted(w for w, v in self.workers.items() if v.state.model == base)
        return [self._candidate(w, hashes) for w in ids]

    def _candidate(self, worker_id: str, hashes: Sequence[int]) -> Candidate:
        view = self.workers[worker_id]
        cached = self.index.cached_blocks(worker_id, hashes) if hashes else 0
        queued = self.queued_tokens.get(worker_id, 0) if self.count_queued_tokens else None
        pending = frozenset(held) if (held := self._adapters.get(worker_id)) else frozenset()  # shared empty
        return Candidate(view.state, view.queue_len, cached, queued, pending)

    def route(
        self,
        profile: RoutingProfile,
        request: RouteRequest,
        rng: random.Random,
        decision_id: str,
        shadow: RoutingProfile | None = None,
    ) -> Routed:
        """Run `profile` (and `shadow`, on the same candidates, when a worker was chosen) and reserve the
        chosen worker for the request."""
        candidates = self.candidates(request.base, request.block_hashes)
        decision = profile.route(request, candidates, rng, decision_id)
        if decision.worker_id is None:
            return Routed(decision, None)
        other = shadow.route(request, candidates, rng, decision_id) if shadow is not None else None
        if self.record_routed:
            self.index.record_routed(decision.worker_id, request.block_hashes)
        reservation = self.reserve(decision.worker_id, request.prompt_tokens, request.adapter)
        return Routed(decision, reservation, other)

    def reserve(self, worker_id: str, prompt_tokens: int, adapter: str | None = None) -> Reservation:
        """Hold one request (its prompt's prefill, its adapter) on `worker_id`."""
        self.note_enqueued(worker_id)
        self.queue_tokens(worker_id, prompt_tokens)
        self.hold_adapter(worker_id, adapter)
        return Reservation(self, worker_id, prompt_tokens, adapter)


def make_route_request(
    *,
    request_id: str,
    tenant: str,
    base: str,
    adapter: str | None,
    prompt_tokens: int,
    max_tokens: int,
    block_hashes: Sequence[int],
    block_size: int,
    now: float,
    allowed_tenants: tuple[str, ...] = (),
    prompt_text: str = "",
) -> RouteRequest:
    """The policy's input for one request (the gateway's and the simulator's alike)."""
    return RouteRequest(
        request_id=request_id,
        tenant=tenant,
        base=base,
        adapter=adapter,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        block_hashes=tuple(block_hashes),
        block_size=block_size,
        allowed_tenants=allowed_tenants,
        now=now,
        prompt_text=prompt_text[:PROMPT_TEXT_LIMIT],
    )
