"""`round-robin`: a baseline that takes the candidates in turn, ignoring their scores.

Algorithm: the `k`-th call picks index `k mod n` of the `n` candidates that passed the filters. The call
counter is the one piece of mutable state among the plugins: an `itertools.count`, whose `next` is atomic
under the GIL, owned by this plugin instance and shared by the profiles that reference it. A policy
reload starts a fresh counter. The random source is not used.

Parameters: none.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

from policies.framework import Picker


class RoundRobinPicker(Picker):
    type_name = "round-robin"

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self._calls = itertools.count()

    def pick(self, totals: Sequence[float], rng: random.Random) -> int:
        return next(self._calls) % len(totals)
