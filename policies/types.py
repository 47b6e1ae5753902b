"""The values routing works on: a request, a snapshot of the candidate workers, and the decision.

Pure data (frozen dataclasses), no I/O, no torch: plugins are functions of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from loragate.contracts import AdapterTier
from loragate.messages import WorkerState


class Outcome(StrEnum):
    """Why a decision went the way it did (one metric series per branch)."""

    ROUTED = "routed"  # a candidate was chosen by the profile's scorers and picker
    SINGLE = "single"  # only one candidate passed the filters
    NO_WORKER = "no_worker"  # no worker serves the model
    FILTERED_OUT = "filtered_out"  # workers serve it, but every one was filtered (e.g. queue bound)


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    tenant: str
    base: str  # the resolved base model
    adapter: str | None  # adapter key "{base}:{name}"
    prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...] = ()  # chained, adapter-keyed (loragate.hashing)
    block_size: int = 16
    allowed_tenants: tuple[str, ...] = ()  # the adapter's tenants (empty: everyone)
    now: float = 0.0  # unix time of the decision; 0 = unknown (heartbeat-age checks are skipped)
    prompt_text: str = ""  # the rendered prompt, for difficulty estimation (may be left empty)
    # Routing an alias over several base models at once (see `policies.alias_ladder.Alias`): the alias's
    # ladder of models from smallest to largest, and the rung the request's difficulty band chose.
    # Empty/None otherwise.
    ladder_models: tuple[str, ...] = ()
    target_rung: int | None = None


@dataclass(frozen=True)
class Candidate:
    """One worker as routing sees it for one request."""

    state: WorkerState
    outstanding: int  # requests queued, waiting or running on it
    cached_blocks: int = 0  # leading blocks of this request's prompt it holds (precise or approximate)
    queued_tokens: int | None = None  # prompt tokens queued ahead of this request; None when unknown
    # Adapters of requests this router sent here that have not ended: the worker loads each onto its
    # device for the first of them, so the next one finds it there (its heartbeat may not say so yet).
    pending_adapters: frozenset[str] = frozenset()

    @property
    def worker_id(self) -> str:
        return self.state.worker_id

    def tier(self, adapter: str | None) -> AdapterTier:
        if adapter is None:
            return AdapterTier.NONE
        if adapter in self.state.adapters_device or adapter in self.pending_adapters:
            return AdapterTier.DEVICE
        return AdapterTier.HOST if adapter in self.state.adapters_host else AdapterTier.DISK


@dataclass(frozen=True)
class RouteDecision:
    decision_id: str
    profile: str
    outcome: Outcome
    worker_id: str | None
    reason: str
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # scorer -> worker -> score
    totals: dict[str, float] = field(default_factory=dict)  # worker -> weighted total
    predicted_cached_tokens: int = 0
    adapter_tier: AdapterTier = AdapterTier.NONE
    candidates: tuple[str, ...] = ()
