"""The zoo's base models as data: each one's name, architecture family, shape and seed (no torch, no
transformers: `loragate models make` reads these to see that a built zoo is complete, and returns at
once; `worker.modelzoo.bases` builds them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["llama", "qwen2", "mistral"]


@dataclass(frozen=True)
class BaseSpec:
    """The shape and seed of one zoo base model."""

    name: str
    family: Family
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    seed: int
    initializer_range: float = 0.08
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


BASE_SPECS: tuple[BaseSpec, ...] = (
    BaseSpec("tiny", "llama", 4, 256, 688, 8, 2, seed=1),
    BaseSpec("small", "llama", 8, 512, 1376, 8, 2, seed=2),
    # Logit spread scales with initializer_range·√hidden, so the 128-wide models need a larger range.
    BaseSpec("tiny-qwen2", "qwen2", 2, 128, 344, 4, 2, seed=3, initializer_range=0.1),
    BaseSpec("tiny-mistral", "mistral", 2, 128, 344, 4, 1, seed=4, initializer_range=0.1),
)


def base_spec(name: str) -> BaseSpec:
    """The spec called `name`; raises `KeyError` naming the known ones otherwise."""
    for spec in BASE_SPECS:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown base model {name!r}; known: {[s.name for s in BASE_SPECS]}")
