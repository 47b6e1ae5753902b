"""`queue-bound`: admission control per worker: drop workers whose queue is full.

Algorithm: keep a candidate while `outstanding < max_outstanding` (outstanding = requests queued, waiting
or running on it). When every candidate is dropped the profile answers FILTERED_OUT, which the gateway
turns into 429 with `Retry-After` rather than letting queues grow without bound.

Parameters:
    max_outstanding: the queue bound per worker (default 256, the gateway's `max_queue_per_worker`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.framework import Filter
from policies.types import Candidate, RouteRequest


class QueueBound(Filter):
    type_name = "queue-bound"
    capacity = True
    parameter_names = frozenset({"max_outstanding"})

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.max_outstanding = self.param("max_outstanding", 256, lo=1)

    def keep(self, request: RouteRequest, candidate: Candidate) -> bool:
        return candidate.outstanding < self.max_outstanding
