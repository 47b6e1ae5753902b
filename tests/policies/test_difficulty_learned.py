"""The learned difficulty estimator: learns a separable toy set, saves and loads, reads labelled JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policies.difficulty import DifficultyQuery
from policies.difficulty_learned import Example, LearnedEstimator, accuracy, parse_example, split, train

EASY_WORDS = ["hello", "thanks", "weather", "recipe", "joke", "greeting", "movie", "song"]
HARD_WORDS = ["theorem", "kernel", "compiler", "eigenvalue", "proof", "concurrency", "optimizer", "topology"]


def toy_examples(n: int, seed: int = 0) -> list[Example]:
    """Prompts made of easy words (label 0) or hard words (label 1): separable by vocabulary."""
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        words = HARD_WORDS if i % 2 else EASY_WORDS
        text = " ".join(rng.choice(words, size=6))
        examples.append(Example(DifficultyQuery(text), float(i % 2)))
    return examples


def test_learns_a_separable_toy_dataset() -> None:
    fit, held_out = split(toy_examples(200), 0.25, seed=1)
    model = train(fit, n_buckets=256, epochs=20, seed=0)
    assert accuracy(model, held_out) == 1.0
    assert model.score(DifficultyQuery("proof of the eigenvalue theorem")) > 0.7
    assert model.score(DifficultyQuery("hello, tell me a joke")) < 0.3


def test_progress_callback_sees_the_loss_fall() -> None:
    losses: list[float] = []
    train(toy_examples(64), n_buckets=64, epochs=5, on_epoch=lambda epoch, loss: losses.append(loss))
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_training_is_reproducible_given_a_seed() -> None:
    a, b = (train(toy_examples(64), n_buckets=64, epochs=3, seed=4) for _ in range(2))
    assert np.array_equal(a.weights, b.weights)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = train(toy_examples(32), n_buckets=32, epochs=2)
    model.save(tmp_path / "m.json")
    loaded = LearnedEstimator.load(tmp_path / "m.json")
    query = DifficultyQuery("kernel compiler")
    assert loaded.n_buckets == 32 and loaded.score(query) == pytest.approx(model.score(query), abs=1e-5)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param({"kind": "other"}, id="wrong kind"),
        pytest.param(
            {"kind": "learned-difficulty", "version": 1, "n_buckets": 0, "weights": []}, id="no buckets"
        ),
        pytest.param(
            {"kind": "learned-difficulty", "version": 1, "n_buckets": 4, "weights": [0]}, id="short"
        ),
    ],
)
def test_malformed_models_are_refused(model: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LearnedEstimator.from_dict(model)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        pytest.param("{oops", "not JSON", id="not JSON"),
        pytest.param('{"label": 1}', "'prompt'", id="prompt missing"),
        pytest.param('{"prompt": "x", "label": 2}', "'label'", id="label out of range"),
        pytest.param('{"prompt": "x", "label": true}', "'label'", id="label a boolean"),
        pytest.param('{"prompt": "x", "label": 1, "max_tokens": -1}', "'max_tokens'", id="bad max_tokens"),
    ],
)
def test_bad_lines_name_the_line(line: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as e:
        parse_example(line, "data.jsonl:7")
    assert str(e.value).startswith("data.jsonl:7:")


def test_a_good_line() -> None:
    example = parse_example(json.dumps({"prompt": "p", "label": 0.3, "max_tokens": 9}), "f:1")
    assert example == Example(DifficultyQuery("p", 9), 0.3)


def test_training_needs_examples() -> None:
    with pytest.raises(ValueError):
        train([])
