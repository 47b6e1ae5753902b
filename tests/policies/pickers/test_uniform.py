"""`random`: uniform over the candidates, reproducible with a seeded source."""

from __future__ import annotations

import random
from collections import Counter

from policies.pickers.uniform import UniformPicker


def test_uniform_and_seeded() -> None:
    picker = UniformPicker("random")
    counts = Counter(picker.pick([1.0, 0.0, 0.0], random.Random(seed)) for seed in range(3000))
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 850
    assert picker.pick([0.0] * 5, random.Random(7)) == picker.pick([0.0] * 5, random.Random(7))
