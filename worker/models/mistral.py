"""Mistral (`MistralForCausalLM`, model_type `mistral`): every layer attends through a sliding window.

The window is `sliding_window` (transformers assumes 4096 when the key is absent; `null` means full
attention, as in Mistral 7B v0.2 and later). The context is not capped at the window: the paged
attention kernels mask the keys behind it, so a 32k-context checkpoint serves 32k tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from worker.models.family import ModelFamily, window_size


def mistral_layer_windows(raw: Mapping[str, Any], num_layers: int, source: Path) -> tuple[int | None, ...]:
    return (window_size(raw.get("sliding_window", 4096), "sliding_window", source),) * num_layers


MISTRAL = ModelFamily(
    model_type="mistral",
    architectures=("MistralForCausalLM",),
    layer_windows=mistral_layer_windows,
    defaults=MappingProxyType(
        {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "num_key_value_heads": 8}
    ),
)
