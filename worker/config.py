"""Model and engine configuration: the parts of a Hugging Face `config.json` the engine needs, validated.

Supports the Llama family: `llama`, `qwen2` (q/k/v bias, optional tied embeddings) and `mistral`
(sliding window: the engine caps its context at the window rather than attend past it). Biases are taken
from the checkpoint's tensors, so `attention_bias` / `mlp_bias` variants load too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class ModelLoadError(ValueError):
    """A checkpoint that the engine cannot load, with the reason."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every linear a LoRA adapter may target."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [raw]
    gen = model_dir / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        value = src.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def load_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{model_dir}: model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
        )
    heads = int(raw["num_attention_heads"])
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_rope_config(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=_eos_ids(model_dir, raw),
    )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs. `num_kv_blocks=None` sizes the KV pool from `kv_cache_bytes`. `device` and `dtype` are
    resolved values (`worker.device` turns the `--device` / `--dtype` specs into them)."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 512 * 1024**2
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    host_adapter_bytes: int = 2 * 1024**3
    max_lora_skips: int = 64
    adapters: dict[str, Path] = field(default_factory=dict)
