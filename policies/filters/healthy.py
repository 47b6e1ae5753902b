"""`healthy`: drop workers whose heartbeat is too old to trust.

Algorithm: keep a candidate when `request.now - state.updated_at <= max_age_s`. A request without a clock
(`now == 0`, e.g. in offline replays) keeps every candidate: the fleet view already drops expired heartbeats.

Parameters:
    max_age_s: the oldest heartbeat still considered alive, in seconds (default 5; workers beat about
        every second with a 3 s TTL, so this only bites when the fleet view itself lags).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.framework import Filter
from policies.types import Candidate, RouteRequest


class Healthy(Filter):
    type_name = "healthy"
    parameter_names = frozenset({"max_age_s"})

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.max_age_s = self.param("max_age_s", 5.0, lo=0.0)

    def keep(self, request: RouteRequest, candidate: Candidate) -> bool:
        if request.now == 0:
            return True
        return request.now - candidate.state.updated_at <= self.max_age_s
