"""`load_model_config`: the shared keys, each family's defaults and sliding windows, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from worker.config import ModelLoadError
from worker.models import load_model_config

LLAMA, QWEN2, MISTRAL = ["LlamaForCausalLM"], ["Qwen2ForCausalLM"], ["MistralForCausalLM"]
BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
}


def write_config(tmp_path: Path, **keys: Any) -> Path:
    raw = {**BASE, **keys}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v != "absent"}))
    return tmp_path


@pytest.mark.parametrize(
    ("keys", "windows"),
    [
        ({"architectures": LLAMA, "sliding_window": 8}, (None,) * 4),
        ({"architectures": MISTRAL, "sliding_window": 4096}, (4096,) * 4),
        # transformers' MistralConfig assumes 4096 when the key is absent; null is full attention.
        ({"architectures": MISTRAL, "sliding_window": "absent"}, (4096,) * 4),
        ({"architectures": MISTRAL, "sliding_window": None}, (None,) * 4),
        # Qwen2: only with use_sliding_window, and only from max_window_layers on (default 28).
        ({"architectures": QWEN2, "sliding_window": 32}, (None,) * 4),
        ({"architectures": QWEN2, "use_sliding_window": True, "sliding_window": 32}, (None,) * 4),
        (
            {"architectures": QWEN2, "use_sliding_window": True, "max_window_layers": 2},
            (None, None, 4096, 4096),
        ),
        (
            {
                "architectures": QWEN2,
                "use_sliding_window": True,
                "sliding_window": 32,
                "max_window_layers": 0,
                "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
            },
            (None, 32, None, 32),
        ),
    ],
    ids=[
        "llama-ignores-window",
        "mistral",
        "mistral-default-window",
        "mistral-null-window",
        "qwen2-window-off",
        "qwen2-window-past-default-max-window-layers",
        "qwen2-max-window-layers",
        "qwen2-layer-types-win",
    ],
)
def test_sliding_windows_per_layer_follow_transformers(
    tmp_path: Path, keys: dict[str, Any], windows: tuple[int | None, ...]
) -> None:
    cfg = load_model_config(write_config(tmp_path, **keys))
    assert cfg.layer_windows == windows
    assert [cfg.window(i) for i in range(4)] == list(windows)
    # A window masks keys in attention; the context stays the model's full length.
    assert cfg.max_model_len == 32768


def test_shared_keys_and_family_defaults(tmp_path: Path) -> None:
    cfg = load_model_config(
        write_config(
            tmp_path,
            architectures=MISTRAL,
            head_dim=32,
            max_position_embeddings="absent",
            num_key_value_heads=None,
            rope_theta=1e6,
            eos_token_id=[2, 7],
        )
    )
    assert (cfg.model_type, cfg.head_dim, cfg.num_kv_heads, cfg.rope.theta) == ("mistral", 32, 4, 1e6)
    assert cfg.max_position_embeddings == 4096 * 32  # MistralConfig's default
    assert cfg.eos_token_ids == (2, 7)
    absent = load_model_config(write_config(tmp_path, architectures=MISTRAL, num_key_value_heads="absent"))
    assert absent.num_kv_heads == 8  # MistralConfig's default when the key is absent (null: one per head)
    qwen = load_model_config(write_config(tmp_path, architectures=QWEN2, max_position_embeddings="absent"))
    assert (qwen.max_position_embeddings, qwen.head_dim) == (32768, 16)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"architectures": LLAMA, "hidden_size": "absent"}, "missing key 'hidden_size'"),
        ({"architectures": LLAMA, "num_hidden_layers": 0}, "num_hidden_layers must be a positive"),
        ({"architectures": MISTRAL, "sliding_window": 0}, "sliding_window must be a positive"),
        ({"architectures": LLAMA, "num_key_value_heads": 0}, "num_key_value_heads must be a positive"),
        ({"architectures": LLAMA, "head_dim": "x"}, "head_dim must be a positive integer"),
        ({"architectures": LLAMA, "rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
        (
            {"architectures": QWEN2, "use_sliding_window": True, "layer_types": ["full_attention"]},
            "layer_types must list one of",
        ),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures ['GPT2LMHeadModel'] are not supported"),
    ],
    ids=[
        "missing-key",
        "zero-layers",
        "zero-window",
        "zero-kv-heads",
        "text-head-dim",
        "negative-eps",
        "short-layer-types",
        "unsupported",
    ],
)
def test_malformed_configs_are_named_errors(tmp_path: Path, keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        load_model_config(write_config(tmp_path, **keys))
    assert message in str(err.value) and "config.json" in str(err.value)


def test_a_folder_without_a_readable_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_model_config(tmp_path)
