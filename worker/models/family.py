"""What makes a model family: its names, its config quirks and where its checkpoint keeps each tensor.

A family is data, not code: the forward pass (`worker.model`), RMSNorm, rotary embeddings, paged
attention and the SGMV LoRA path are shared by every family, and a family module (`llama`, `qwen2`,
`mistral`) only says what differs: the `architectures`/`model_type` names that select it, the defaults
transformers assumes for keys a `config.json` leaves out, which layers attend through a sliding window,
which biases its checkpoints must hold, and the tensor names (`WeightNames`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from worker.config import ModelLoadError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True, slots=True)
class WeightNames:
    """Tensor names in a checkpoint; `layer` is formatted with the layer index `i`."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{i}."
    input_norm: str = "input_layernorm.weight"
    post_norm: str = "post_attention_layernorm.weight"
    attention: str = "self_attn."
    mlp: str = "mlp."
    # Buffers some checkpoints carry that the engine recomputes.
    ignored: tuple[str, ...] = ("rotary_emb",)

    def prefix(self, layer: int) -> str:
        return self.layer.format(i=layer)

    def module(self, layer: int, module: str) -> str:
        """The name of a projection (`q_proj` … `down_proj`) of `layer`, without `.weight`/`.bias`."""
        block = self.attention if module in ATTENTION_MODULES else self.mlp
        return self.prefix(layer) + block + module


# Maps config.json and the layer count to one window (or None: full attention) per layer.
LayerWindows = Callable[[Mapping[str, Any], int, Path], tuple[int | None, ...]]


def full_attention(raw: Mapping[str, Any], num_layers: int, source: Path) -> tuple[int | None, ...]:
    """Every layer attends to the whole context."""
    return (None,) * num_layers


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One architecture family, registered by its `architectures` names and its `model_type`."""

    model_type: str
    architectures: tuple[str, ...]
    layer_windows: LayerWindows = full_attention
    # The values transformers' config class assumes when config.json leaves a key out.
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Projections whose bias every checkpoint of the family holds (a missing one is an error).
    required_biases: tuple[str, ...] = ()
    weights: WeightNames = WeightNames()


def window_size(value: Any, key: str, source: Path) -> int | None:
    """A config's window: None, or a positive int (anything else is a `ModelLoadError` naming `key`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{source}: {key} must be a positive integer or null, got {value!r}")
    return value
