"""`weighted-random`: choose at random, favouring higher totals (a softmax over the totals).

Algorithm: `P(i) ∝ exp((total_i - max_total) / temperature)`, sampled with the request's random source.
Small temperatures approach `max`; large ones approach uniform. Spreading requests this way keeps many
gateways that see the same stale snapshot from all sending their next request to the same worker.

Parameters:
    temperature: the softmax temperature in total units (totals lie in [0, 1]), > 0 (default 0.1:
        a candidate 0.1 behind the best is chosen e≈2.7 times less often).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from policies.framework import Picker


class WeightedRandomPicker(Picker):
    type_name = "weighted-random"
    parameter_names = frozenset({"temperature"})

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.temperature = self.param("temperature", 0.1, lo=1e-6)

    def probabilities(self, totals: Sequence[float]) -> list[float]:
        best = max(totals)
        weights = [math.exp((t - best) / self.temperature) for t in totals]
        norm = sum(weights)  # ≥ 1: the best candidate's weight is exp(0)
        return [w / norm for w in weights]

    def pick(self, totals: Sequence[float], rng: random.Random) -> int:
        draw = rng.random()
        for i, p in enumerate(self.probabilities(totals)):
            draw -= p
            if draw < 0:
                return i
        return len(totals) - 1  # rounding left a sliver past the last bucket
