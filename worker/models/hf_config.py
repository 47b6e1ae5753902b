"""Read a Hugging Face `config.json` into a `ModelConfig`, through the family it selects.

The keys every supported family shares (sizes, heads, RoPE, norms, EOS ids) are read here once; the
family supplies the defaults of absent keys and the per-layer attention windows. Missing or malformed
keys are a `ModelLoadError` naming the file and the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worker.config import ModelConfig, ModelLoadError, RopeConfig
from worker.models.family import ModelFamily
from worker.models.registry import family_for


def _rope_config(raw: Mapping[str, Any], source: Path) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(
            f"{source}: unsupported rope scaling type {kind!r} (supported: default, linear, llama3)"
        )
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(model_dir: Path, raw: Mapping[str, Any]) -> tuple[int, ...]:
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


class _Keys:
    """config.json values: required ones, or the family's default, or a generic fallback."""

    def __init__(self, raw: Mapping[str, Any], family: ModelFamily, source: Path):
        self.raw, self.family, self.source = raw, family, source

    def required(self, key: str) -> int:
        if key not in self.raw:
            raise ModelLoadError(f"{self.source}: missing key {key!r}")
        return self._int(key, self.raw[key])

    def optional(self, key: str, fallback: Any) -> Any:
        value = self.raw.get(key)
        return self.family.defaults.get(key, fallback) if value is None else value

    def optional_int(self, key: str, fallback: int) -> int:
        return self._int(key, self.optional(key, fallback))

    def optional_float(self, key: str, fallback: float) -> float:
        value = self.optional(key, fallback)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"{self.source}: {key} must be a positive number, got {value!r}")
        return float(value)

    def _int(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{self.source}: {key} must be a positive integer, got {value!r}")
        return value


def load_model_config(model_dir: Path) -> ModelConfig:
    """The engine's view of `model_dir/config.json` (and `generation_config.json`'s EOS ids)."""
    path = model_dir / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    family = family_for(raw, path)
    keys = _Keys(raw, family, path)
    heads = keys.required("num_attention_heads")
    hidden = keys.required("hidden_size")
    num_layers = keys.required("num_hidden_layers")
    # transformers: an explicit null means one KV head per query head; an absent key, the family default.
    kv_null = "num_key_value_heads" in raw and raw["num_key_value_heads"] is None
    return ModelConfig(
        model_type=family.model_type,
        vocab_size=keys.required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=keys.required("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads if kv_null else keys.optional_int("num_key_value_heads", heads),
        head_dim=keys.optional_int("head_dim", hidden // heads),
        rms_norm_eps=keys.optional_float("rms_norm_eps", 1e-6),
        max_position_embeddings=keys.optional_int("max_position_embeddings", 2048),
        rope=_rope_config(raw, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        layer_windows=family.layer_windows(raw, num_layers, path),
        eos_token_ids=_eos_ids(model_dir, raw),
    )
