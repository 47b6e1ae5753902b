"""`random`: a baseline that picks a candidate uniformly at random, ignoring their scores.

Algorithm: `rng.randrange(n)` with the request's random source, so a seeded source replays exactly.

Parameters: none.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.framework import Picker


class UniformPicker(Picker):
    type_name = "random"

    def pick(self, totals: Sequence[float], rng: random.Random) -> int:
        return rng.randrange(len(totals))
