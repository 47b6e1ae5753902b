"""`prefix`: the share of the prompt's blocks the worker caches; 0 for a prompt without full blocks."""

from __future__ import annotations

import pytest

from policies.scorers.prefix import PrefixScorer
from tests.policies.factories import candidate, request


@pytest.mark.parametrize(
    ("hashes", "cached", "expected"),
    [
        pytest.param((), 0, 0.0, id="no full block"),
        pytest.param((1, 2, 3, 4), 0, 0.0, id="nothing cached"),
        pytest.param((1, 2, 3, 4), 3, 0.75, id="part cached"),
        pytest.param((1, 2), 5, 1.0, id="stale count above the prompt is capped"),
    ],
)
def test_prefix(hashes: tuple[int, ...], cached: int, expected: float) -> None:
    scores = PrefixScorer("prefix").score(request(block_hashes=hashes), [candidate(cached_blocks=cached)])
    assert scores == [pytest.approx(expected)]
