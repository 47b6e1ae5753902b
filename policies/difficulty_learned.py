"""A learned difficulty estimator: logistic regression on hashed words plus the heuristic's features.

Features: the prompt's lower-cased words and punctuation (`\\w+|[^\\w\\s]`), unigrams and bigrams, hashed
with CRC-32 into `n_buckets` buckets (present = 1, scaled by `1/√count` so long prompts do not dominate),
followed by the five numeric features of `policies.difficulty.features`. The model is
`score = σ(w · x + b)`.

Training (`train`) is mini-batch gradient descent on the logistic loss with L2 regularisation, in plain
numpy, on labelled examples `{"prompt": str, "label": 0 | 1 | float in [0, 1], "max_tokens": int?}`
(one JSON object per line; soft labels are fine). Parameters of `train`:

    n_buckets: hash buckets (default 2048): more separates rarer words, costs 8 bytes each in the model file
    epochs: passes over the data (default 30); batch_size: examples per step (default 64)
    learning_rate: step size (default 0.5); l2: weight decay per step (default 1e-4)
    seed: shuffling seed, so training is reproducible

The model is saved as JSON: `{"kind": "learned-difficulty", "version": 1, "n_buckets": N, "bias": b,
"weights": [N + 5 floats]}`.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.difficulty import FEATURE_NAMES, DifficultyQuery, features

WORD = re.compile(r"\w+|[^\w\s]")
KIND, VERSION = "learned-difficulty", 1


@dataclass(frozen=True)
class Example:
    query: DifficultyQuery
    label: float


def hashed(text: str, n_buckets: int) -> np.ndarray:
    """Sorted distinct bucket indices of the text's unigrams and bigrams."""
    words = WORD.findall(text.lower())
    grams = words + [f"{a} {b}" for a, b in itertools.pairwise(words)]
    return np.unique(np.fromiter((zlib.crc32(g.encode()) % n_buckets for g in grams), dtype=np.int64))


def encode(query: DifficultyQuery, n_buckets: int) -> tuple[np.ndarray, tuple[float, ...]]:
    """The query's sparse form: its hash buckets and its numeric features."""
    return hashed(query.text, n_buckets), features(query)


def dense(rows: Sequence[tuple[np.ndarray, tuple[float, ...]]], n_buckets: int) -> np.ndarray:
    """Encoded rows as a (len(rows), n_buckets + 5) matrix; built per batch to keep training memory small."""
    x = np.zeros((len(rows), n_buckets + len(FEATURE_NAMES)), dtype=np.float64)
    for row, (buckets, numeric) in enumerate(rows):
        if buckets.size:
            x[row, buckets] = 1.0 / math.sqrt(buckets.size)
        x[row, n_buckets:] = numeric
    return x


def featurize(queries: Sequence[DifficultyQuery], n_buckets: int) -> np.ndarray:
    return dense([encode(q, n_buckets) for q in queries], n_buckets)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0)))


@dataclass(frozen=True, eq=False)
class LearnedEstimator:
    n_buckets: int
    weights: np.ndarray = field(repr=False)
    bias: float = 0.0

    def score(self, query: DifficultyQuery) -> float:
        return float(self.scores([query])[0])

    def scores(self, queries: Sequence[DifficultyQuery]) -> np.ndarray:
        return sigmoid(featurize(queries, self.n_buckets) @ self.weights + self.bias)

    def to_dict(self) -> dict[str, Any]:
        weights = [round(float(w), 6) for w in self.weights]
        return {"kind": KIND, "version": VERSION, "n_buckets": self.n_buckets, "bias": self.bias,
                "weights": weights}  # fmt: skip

    @staticmethod
    def from_dict(d: Any) -> LearnedEstimator:
        """Raises ValueError when `d` is not a model this version wrote."""
        if not isinstance(d, dict) or d.get("kind") != KIND or d.get("version") != VERSION:
            raise ValueError(f"not a {KIND} model (version {VERSION})")
        n, weights = d.get("n_buckets"), d.get("weights")
        if not isinstance(n, int) or n < 1 or not isinstance(weights, list):
            raise ValueError("n_buckets must be a positive integer and weights a list")
        if len(weights) != n + len(FEATURE_NAMES):
            raise ValueError(f"expected {n + len(FEATURE_NAMES)} weights, got {len(weights)}")
        return LearnedEstimator(n, np.asarray(weights, dtype=np.float64), float(d.get("bias", 0.0)))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict()))

    @staticmethod
    def load(path: Path) -> LearnedEstimator:
        return LearnedEstimator.from_dict(json.loads(path.read_text()))


def parse_example(line: str, where: str) -> Example:
    """One JSONL line; ValueError names `where` (file:line) and the problem."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    prompt, label, max_tokens = (
        d.get(k) if isinstance(d, dict) else None for k in ("prompt", "label", "max_tokens")
    )
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    if isinstance(label, bool) or not isinstance(label, int | float) or not 0 <= label <= 1:
        raise ValueError(f"{where}: 'label' must be 0, 1 or a number in [0, 1]")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"{where}: 'max_tokens' must be a non-negative integer")
    return Example(DifficultyQuery(prompt, max_tokens or 0), float(label))


def read_examples(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    return [parse_example(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]


def split(examples: Sequence[Example], holdout: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A shuffled (train, held-out) split; held-out gets `round(holdout * n)` examples."""
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    cut = len(shuffled) - round(holdout * len(shuffled))
    return shuffled[:cut], shuffled[cut:]


def accuracy(estimator: LearnedEstimator, examples: Sequence[Example]) -> float:
    """Share of examples on the right side of ½ (labels are rounded the same way)."""
    if not examples:
        return float("nan")
    predicted = estimator.scores([e.query for e in examples]) >= 0.5
    truth = np.asarray([e.label for e in examples]) >= 0.5
    return float(np.mean(predicted == truth))


def train(
    examples: Sequence[Example],
    n_buckets: int = 2048,
    epochs: int = 30,
    batch_size: int = 64,
    learning_rate: float = 0.5,
    l2: float = 1e-4,
    seed: int = 0,
    on_epoch: Callable[[int, float], None] | None = None,
) -> LearnedEstimator:
    """Fits the model; `on_epoch(epoch, mean_loss)` is called after each pass (e.g. a progress bar)."""
    if not examples:
        raise ValueError("no training examples")
    rows = [encode(e.query, n_buckets) for e in examples]
    y = np.asarray([e.label for e in examples], dtype=np.float64)
    w, b = np.zeros(n_buckets + len(FEATURE_NAMES)), 0.0
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = rng.permutation(len(y))
        loss = 0.0
        for start in range(0, len(y), batch_size):
            batch = order[start : start + batch_size]
            x = dense([rows[i] for i in batch], n_buckets)
            p = sigmoid(x @ w + b)
            loss += float(-np.sum(y[batch] * np.log(p + 1e-12) + (1 - y[batch]) * np.log(1 - p + 1e-12)))
            error = p - y[batch]
            w -= learning_rate * (x.T @ error / len(batch) + l2 * w)
            b -= learning_rate * float(np.mean(error))
        if on_epoch is not None:
            on_epoch(epoch, loss / len(y))
    return LearnedEstimator(n_buckets, w, b)
