"""The heuristic difficulty estimator: features in [0, 1], monotone noisy-or, validated parameters."""

from __future__ import annotations

from typing import Any

import pytest

from policies.difficulty import DifficultyQuery, HeuristicEstimator, features
from policies.framework import PolicyError

EASY = DifficultyQuery("hi there!")
CODE = DifficultyQuery("```python\ndef f(x):\n    return x\n```\nWhy does this crash? Explain step by step.")
MATH = DifficultyQuery("Prove that the integral of $x^2$ from 0 to 1 is 1/3, then solve 3*x + 2 = 11.")


@pytest.mark.parametrize(
    ("query", "feature", "expected"),
    [
        pytest.param(DifficultyQuery(""), 0, 0.0, id="empty prompt has no length"),
        pytest.param(DifficultyQuery("x", prompt_tokens=2000), 0, 1.0, id="tokenizer count at the scale"),
        pytest.param(DifficultyQuery("x" * 8000 * 4), 0, 1.0, id="estimated tokens capped"),
        pytest.param(DifficultyQuery("hi", max_tokens=0), 1, 0.0, id="no output requested"),
        pytest.param(DifficultyQuery("hi", max_tokens=2048), 1, 1.0, id="long output requested"),
        pytest.param(CODE, 2, 1.0, id="code markers saturate"),
        pytest.param(MATH, 3, 1.0, id="math markers saturate"),
        pytest.param(DifficultyQuery("why? explain."), 4, pytest.approx(2 / 3), id="two reasoning words"),
        pytest.param(EASY, 2, 0.0, id="no markers"),
    ],
)
def test_features(query: DifficultyQuery, feature: int, expected: float) -> None:
    assert features(query)[feature] == expected


@pytest.mark.parametrize(
    ("easier", "harder"),
    [
        pytest.param(EASY, CODE, id="code beats chit-chat"),
        pytest.param(EASY, MATH, id="math beats chit-chat"),
        pytest.param(
            DifficultyQuery("hi", max_tokens=16), DifficultyQuery("hi", max_tokens=1500), id="long output"
        ),
        pytest.param(
            DifficultyQuery("summarise this " * 5), DifficultyQuery("summarise this " * 500), id="long prompt"
        ),
        pytest.param(
            MATH, DifficultyQuery(MATH.text + " Explain why, and compare approaches."), id="more markers"
        ),
    ],
)
def test_heuristic_is_monotone_in_obvious_cases(easier: DifficultyQuery, harder: DifficultyQuery) -> None:
    estimator = HeuristicEstimator()
    assert 0.0 <= estimator.score(easier) < estimator.score(harder) <= 1.0


def test_easy_and_hard_fall_on_either_side_of_the_default_band() -> None:
    estimator = HeuristicEstimator()
    assert estimator.score(EASY) < 0.4 < estimator.score(MATH)


@pytest.mark.parametrize(
    ("parameters", "path"),
    [
        pytest.param({"code_weight": 1.5}, "difficulty.parameters.code_weight", id="weight above 1"),
        pytest.param({"length_scale": 0}, "difficulty.parameters.length_scale", id="scale not positive"),
        pytest.param({"colour": 1}, "difficulty.parameters.colour", id="unknown parameter"),
    ],
)
def test_bad_parameters(parameters: dict[str, Any], path: str) -> None:
    with pytest.raises(PolicyError) as e:
        HeuristicEstimator.from_parameters(parameters, "difficulty.parameters")
    assert e.value.path == path


def test_parameters_are_applied() -> None:
    estimator = HeuristicEstimator.from_parameters({"code_weight": 1.0}, "p")
    assert estimator.code_weight == 1.0 and estimator.score(CODE) == 1.0
