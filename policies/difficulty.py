"""How hard a request looks, as a score in [0, 1], so `model: "auto"` can send easy prompts to a small model.

Features (each in [0, 1], shared with the learned estimator in `policies.difficulty_learned`):

    length     log(1 + prompt_tokens) / log(1 + length_scale), capped at 1
    output     log(1 + max_tokens) / log(1 + output_scale), capped at 1 (0 when not requested)
    code       code markers (fences, `def f(`, `import x`, `#include`, `=>`, `SELECT … FROM`, …)
    math       math markers (`$…$`, `\\frac`, `∫`, "integral", "prove", "solve", `3*x + 2 = 7`, …)
    reasoning  reasoning words ("why", "explain", "step by step", "compare", "trade-off", …)

Marker features count regex matches and saturate: `min(1, matches / marker_saturation)`. Prompt tokens
are the tokenizer's count when the caller has it, else estimated as `len(text) / 4`.

`HeuristicEstimator` combines them as a noisy-or, `score = 1 - Π (1 - weight_f · feature_f)`: each
feature alone can raise the score up to its weight, the score only grows when any feature grows
(monotone), and it stays in [0, 1]. Parameters (all optional):

    length_weight, output_weight, code_weight, math_weight, reasoning_weight: in [0, 1]
        (defaults 0.3, 0.25, 0.5, 0.5, 0.35)
    length_scale: prompt tokens at which `length` reaches 1, > 0 (default 2000)
    output_scale: requested tokens at which `output` reaches 1, > 0 (default 2048)
    marker_saturation: marker matches at which a marker feature reaches 1, > 0 (default 3)

Any object with `score(query) -> float` is an `Estimator`; the policy document chooses one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

from policies import validate

FEATURE_NAMES = ("length", "output", "code", "math", "reasoning")

CODE_MARKERS = re.compile(
    r"```|\bdef \w+\(|\bclass \w+[:(]|^\s*(?:import|from) \w+|#include|=>|\bfunction\b|\breturn\b"
    r"|\bSELECT\b[\s\S]*\bFROM\b|\bstd::|\bconsole\.|\bTraceback\b|[{};]\s*$|\bstack trace\b|\bsegfault\b"
    r"|\b(?:python|javascript|typescript|rust|golang|java|c\+\+|sql|regex|compile[rd]?)\b",
    re.IGNORECASE | re.MULTILINE,
)
MATH_MARKERS = re.compile(
    r"\$[^$\n]+\$|\\(?:frac|sum|int|sqrt|prod|lim)\b|[∫∑∏√≤≥≠∞π]|\d\s*[-+*/^=<>]\s*\(?[\dxyzn]"
    r"|\b(?:integral|derivative|equation|theorem|lemma|prove|proof|solve|probability|matrix|eigen\w*"
    r"|polynomial|limit|modulo|prime|inequality|geometry|algebra|calculus)\b",
    re.IGNORECASE,
)
REASONING_MARKERS = re.compile(
    r"\b(?:why|explain|step[- ]by[- ]step|analy[sz]e|compare|contrast|trade-?offs?|derive|justify"
    r"|evaluate|critique|design|optimi[sz]e|reason(?:ing)?|implications?|pros and cons|plan)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class DifficultyQuery:
    """What the estimator sees: the prompt text, requested output length, and prompt tokens if known."""

    text: str
    max_tokens: int = 0
    prompt_tokens: int = 0  # 0: estimate from the text

    @property
    def tokens(self) -> int:
        return self.prompt_tokens or (len(self.text) + 3) // 4


class Estimator(Protocol):
    def score(self, query: DifficultyQuery) -> float:
        """The request's difficulty in [0, 1]; higher means it needs a bigger model."""
        ...


def log_ratio(value: float, scale: float) -> float:
    return min(1.0, math.log1p(max(0.0, value)) / math.log1p(scale))


def features(
    query: DifficultyQuery, length_scale: float = 2000, output_scale: float = 2048, saturation: float = 3
) -> tuple[float, ...]:
    """The five features in `FEATURE_NAMES` order, each in [0, 1]."""
    text = query.text

    def markers(pattern: re.Pattern[str]) -> float:
        return min(1.0, len(pattern.findall(text)) / saturation)

    return (
        log_ratio(query.tokens, length_scale),
        log_ratio(query.max_tokens, output_scale),
        markers(CODE_MARKERS),
        markers(MATH_MARKERS),
        markers(REASONING_MARKERS),
    )


@dataclass(frozen=True)
class HeuristicEstimator:
    length_weight: float = 0.3
    output_weight: float = 0.25
    code_weight: float = 0.5
    math_weight: float = 0.5
    reasoning_weight: float = 0.35
    length_scale: float = 2000
    output_scale: float = 2048
    marker_saturation: float = 3

    @staticmethod
    def from_parameters(parameters: Mapping[str, Any], path: str) -> HeuristicEstimator:
        """From the policy's `difficulty.parameters`; `PolicyError` names a bad or unknown key."""
        names = [f.name for f in fields(HeuristicEstimator)]
        validate.known_keys(parameters, path, names)
        values: dict[str, float] = {}
        for name, value in parameters.items():
            where = validate.key_path(path, name)
            if name.endswith("_weight"):
                values[name] = validate.number(value, where, 0.0, 1.0)
            else:
                values[name] = validate.positive(value, where)
        return HeuristicEstimator(**values)

    @property
    def weights(self) -> tuple[float, ...]:
        return (self.length_weight, self.output_weight, self.code_weight, self.math_weight,
                self.reasoning_weight)  # fmt: skip

    def score(self, query: DifficultyQuery) -> float:
        values = features(query, self.length_scale, self.output_scale, self.marker_saturation)
        easy = 1.0
        for weight, value in zip(self.weights, values, strict=True):
            easy *= 1.0 - weight * value
        return 1.0 - easy
