"""`adapter`: prefer the worker where the request's adapter is cheapest to use (device > host > disk).

Algorithm: look up where the worker holds the adapter (`Candidate.tier`), take that tier's load cost in
seconds (`policies.load_cost`), and score `1 / (1 + cost / scale_s)`: 1 for a free load, ½ when the load
costs `scale_s`, towards 0 for slow loads. A request without an adapter scores 1 everywhere (neutral).

Parameters:
    device_s, host_s, disk_s: the load cost per tier in seconds (defaults 0, 0.005, 0.05).
    scale_s: the load cost that halves the score, in seconds, > 0 (default 0.01; with the defaults
        device scores 1, host 0.67, disk 0.17).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loragate.contracts import AdapterTier
from policies.framework import Scorer
from policies.load_cost import PARAMETER_NAMES, AdapterLoadCost
from policies.types import Candidate, RouteRequest


class AdapterScorer(Scorer):
    type_name = "adapter"
    parameter_names = PARAMETER_NAMES | {"scale_s"}

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.costs = AdapterLoadCost.from_plugin(self)
        self.scale_s = self.param("scale_s", 0.01, lo=1e-9)

    def score_tier(self, tier: AdapterTier) -> float:
        if tier is AdapterTier.NONE:
            return 1.0
        return 1.0 / (1.0 + self.costs.seconds(tier) / self.scale_s)

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [self.score_tier(c.tier(request.adapter)) for c in candidates]
