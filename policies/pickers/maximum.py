"""`max`: choose the candidate with the highest weighted total; break ties at random.

Algorithm: every candidate within `tie_epsilon` of the best total is a tie, and the request's random
source chooses among them, so equal workers share load instead of the first one taking everything, and
a seeded source gives the same choice every time.

Parameters:
    tie_epsilon: totals closer than this to the best count as ties, ≥ 0 (default 1e-9).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from policies.framework import Picker


class MaxPicker(Picker):
    type_name = "max"
    parameter_names = frozenset({"tie_epsilon"})

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.tie_epsilon = self.param("tie_epsilon", 1e-9, lo=0)

    def pick(self, totals: Sequence[float], rng: random.Random) -> int:
        best = max(totals)
        ties = [i for i, t in enumerate(totals) if t >= best - self.tie_epsilon]
        return ties[0] if len(ties) == 1 else rng.choice(ties)
