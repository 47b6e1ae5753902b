"""`difficulty`: closeness of a candidate's model to the rung the request's difficulty chose."""

from __future__ import annotations

from typing import Any

import pytest

from policies.scorers.difficulty import DifficultyScorer
from tests.policies.factories import candidate, request

LADDER = {"ladder_models": ("tiny", "small", "large")}


@pytest.mark.parametrize(
    ("req", "model", "expected"),
    [
        pytest.param({}, "tiny", 1.0, id="no ladder: neutral"),
        pytest.param({"ladder_models": ("tiny",), "target_rung": 0}, "tiny", 1.0, id="one rung: neutral"),
        pytest.param({**LADDER, "target_rung": 2}, "other", 0.0, id="model not on the ladder"),
        pytest.param({**LADDER, "target_rung": 2}, "large", 1.0, id="the chosen rung"),
        pytest.param({**LADDER, "target_rung": 2}, "small", 0.5, id="one rung away"),
        pytest.param({**LADDER, "target_rung": 2}, "tiny", 0.0, id="the far end"),
    ],
)
def test_difficulty(req: dict[str, Any], model: str, expected: float) -> None:
    scores = DifficultyScorer("difficulty").score(request(**req), [candidate(model=model)])
    assert scores == [pytest.approx(expected)]
