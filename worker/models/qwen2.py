"""Qwen2 (`Qwen2ForCausalLM`, model_type `qwen2`): q/k/v biases, and an optional per-layer sliding window.

As in transformers' `Qwen2Config`, a window applies only when `use_sliding_window` is true, and then to
the layers `layer_types` marks `sliding_attention`, or, without `layer_types`, to the layers from
`max_window_layers` on. Released Qwen2/2.5 checkpoints set `use_sliding_window: false`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from worker.config import ModelLoadError
from worker.models.family import ModelFamily, window_size

LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen2_layer_windows(raw: Mapping[str, Any], num_layers: int, source: Path) -> tuple[int | None, ...]:
    window = window_size(raw.get("sliding_window", 4096), "sliding_window", source)
    if not raw.get("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise ModelLoadError(
            f"{source}: layer_types must list one of {LAYER_TYPES} for each of the {num_layers} layers, "
            f"got {types!r}"
        )
    return tuple(window if t == "sliding_attention" else None for t in types)


QWEN2 = ModelFamily(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    layer_windows=qwen2_layer_windows,
    defaults=MappingProxyType({"max_position_embeddings": 32768, "rms_norm_eps": 1e-6}),
    required_biases=("q_proj", "k_proj", "v_proj"),
)
