"""The `difficulty` section: heuristic with parameters, learned from a file or inline, errors by path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from policies.difficulty import DifficultyQuery, HeuristicEstimator
from policies.difficulty_learned import Example, LearnedEstimator, train
from policies.estimators import build_estimator
from policies.framework import PolicyError

MODEL = train([Example(DifficultyQuery("proof"), 1.0), Example(DifficultyQuery("hello"), 0.0)], 16, epochs=2)


def test_heuristic_by_default() -> None:
    assert build_estimator({}) == HeuristicEstimator()


def test_heuristic_with_parameters() -> None:
    estimator = build_estimator({"estimator": "heuristic", "parameters": {"math_weight": 0.9}})
    assert estimator == HeuristicEstimator(math_weight=0.9)


def test_learned_from_a_relative_path(tmp_path: Path) -> None:
    MODEL.save(tmp_path / "m.json")
    estimator = build_estimator({"estimator": "learned", "path": "m.json"}, base_dir=tmp_path)
    assert isinstance(estimator, LearnedEstimator) and estimator.n_buckets == 16


def test_learned_inline() -> None:
    estimator = build_estimator({"estimator": "learned", "model": MODEL.to_dict()})
    assert isinstance(estimator, LearnedEstimator)


@pytest.mark.parametrize(
    ("section", "path"),
    [
        pytest.param([], "difficulty", id="not an object"),
        pytest.param({"estimator": "heuristic", "path": "m.json"}, "difficulty.path", id="path on heuristic"),
        pytest.param({"estimator": "learned"}, "difficulty", id="learned without a model"),
        pytest.param(
            {"estimator": "learned", "path": "a", "model": {}}, "difficulty", id="learned with both"
        ),
        pytest.param(
            {"estimator": "learned", "parameters": {}}, "difficulty.parameters", id="learned parameters"
        ),
        pytest.param(
            {"estimator": "learned", "path": "missing.json"}, "difficulty.path", id="unreadable file"
        ),
        pytest.param({"estimator": "learned", "model": {"kind": "x"}}, "difficulty.model", id="not a model"),
        pytest.param(
            {"estimator": "heuristic", "parameters": 3}, "difficulty.parameters", id="parameters not a map"
        ),
        pytest.param({"estimator": "heuristic", "extra": 1}, "difficulty.extra", id="unknown key"),
    ],
)
def test_errors(tmp_path: Path, section: Any, path: str) -> None:
    with pytest.raises(PolicyError) as e:
        build_estimator(section, base_dir=tmp_path)
    assert e.value.path == path


def test_unparseable_model_file(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text("{nope")
    with pytest.raises(PolicyError) as e:
        build_estimator({"estimator": "learned", "path": str(tmp_path / "m.json")})
    assert e.value.path == "difficulty.path" and "cannot read" in e.value.message
