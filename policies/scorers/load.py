"""`load`: prefer the least busy worker, by queue depth, running sequences and free KV cache.

Algorithm: three headroom terms in [0, 1], averaged with weights:

    queue   = 1 - min(1, outstanding / capacity)
    running = 1 - min(1, state.running / max_running)
    kv      = kv_blocks_free / kv_blocks_total   (1 when the worker reports no KV size)

`outstanding` (requests queued, waiting or running; never stale) is the main signal; `running` and `kv`
come from the heartbeat and separate workers with equal queues but different batch and memory pressure.

Parameters:
    capacity: outstanding requests at which the queue term reaches 0 (default 32, > 0).
    max_running: running sequences at which the running term reaches 0 (default 64, > 0).
    queue_weight, running_weight, kv_weight: the terms' weights, ≥ 0, not all 0
        (defaults 0.5, 0.25, 0.25).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.framework import PolicyError, Scorer
from policies.types import Candidate, RouteRequest


class LoadScorer(Scorer):
    type_name = "load"
    parameter_names = frozenset({"capacity", "max_running", "queue_weight", "running_weight", "kv_weight"})

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.capacity = self.param("capacity", 32, lo=1e-9)
        self.max_running = self.param("max_running", 64, lo=1e-9)
        self.weights = (
            self.param("queue_weight", 0.5, lo=0),
            self.param("running_weight", 0.25, lo=0),
            self.param("kv_weight", 0.25, lo=0),
        )
        if sum(self.weights) == 0:
            raise PolicyError("parameters.queue_weight", "at least one of the three weights must be > 0")

    def score_one(self, candidate: Candidate) -> float:
        state = candidate.state
        queue = 1.0 - min(1.0, candidate.outstanding / self.capacity)
        running = 1.0 - min(1.0, state.running / self.max_running)
        kv = state.kv_blocks_free / state.kv_blocks_total if state.kv_blocks_total > 0 else 1.0
        terms = (queue, running, kv)
        return sum(w * t for w, t in zip(self.weights, terms, strict=True)) / sum(self.weights)

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [self.score_one(c) for c in candidates]
