"""`weighted-random`: softmax over totals at `temperature`, sampled with the random source."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from policies.pickers.weighted_random import WeightedRandomPicker


@pytest.mark.parametrize(
    ("temperature", "totals", "expected"),
    [
        pytest.param(0.1, [0.5, 0.5], [0.5, 0.5], id="equal totals: uniform"),
        pytest.param(0.1, [1.0, 0.9], [1 / (1 + math.exp(-1)), 1 - 1 / (1 + math.exp(-1))], id="0.1 behind"),
        pytest.param(1e-6, [1.0, 0.5], [1.0, 0.0], id="cold: argmax"),
    ],
)
def test_probabilities(temperature: float, totals: list[float], expected: list[float]) -> None:
    picker = WeightedRandomPicker("w", {"temperature": temperature})
    assert picker.probabilities(totals) == pytest.approx(expected)


def test_sampling_follows_the_probabilities() -> None:
    picker, rng = WeightedRandomPicker("w", {"temperature": 0.1}), random.Random(1)
    counts = Counter(picker.pick([1.0, 0.9], rng) for _ in range(4000))
    assert counts[0] / 4000 == pytest.approx(1 / (1 + math.exp(-1)), abs=0.03)


class _EdgeRandom(random.Random):
    def random(self) -> float:
        return 1.0 - 1e-17  # rounds to 1.0: the draw lands past the last bucket


def test_a_draw_past_the_last_bucket_takes_the_last() -> None:
    assert WeightedRandomPicker("w").pick([0.5, 0.5, 0.5], _EdgeRandom()) == 2
