"""`max`: the best total; ties broken by the random source."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies.pickers.maximum import MaxPicker


@pytest.mark.parametrize(
    ("totals", "allowed"),
    [
        pytest.param([0.2, 0.9, 0.5], {1}, id="single best"),
        pytest.param([0.9, 0.2, 0.9], {0, 2}, id="tie broken at random"),
        pytest.param([0.9, 0.2, 0.9 - 1e-12], {0, 2}, id="within epsilon is a tie"),
    ],
)
def test_max(totals: list[float], allowed: set[int]) -> None:
    picker = MaxPicker("max")
    assert {picker.pick(totals, random.Random(seed)) for seed in range(50)} == allowed


def test_ties_spread_evenly() -> None:
    rng = random.Random(0)
    counts = Counter(MaxPicker("max").pick([0.5, 0.5], rng) for _ in range(2000))
    assert 800 < counts[0] < 1200
