"""What the family modules carry: tensor names and required biases, proven on the zoo's checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.config import ModelLoadError
from worker.loader import load_weights, read_tensors
from worker.models import family_named, load_model_config
from worker.modelzoo.make import ZooPaths


def test_weight_names_are_the_hf_llama_layout() -> None:
    names = family_named("mistral").weights
    assert names.module(3, "q_proj") == "model.layers.3.self_attn.q_proj"
    assert names.module(0, "down_proj") == "model.layers.0.mlp.down_proj"
    assert names.prefix(1) + names.post_norm == "model.layers.1.post_attention_layernorm.weight"


@pytest.mark.parametrize("base", ["tiny", "tiny-qwen2", "tiny-mistral"])
def test_each_zoo_family_loads_every_tensor(zoo: ZooPaths, base: str) -> None:
    cfg = load_model_config(zoo.base(base))
    weights = load_weights(zoo.base(base), cfg, torch.float32, "cpu")
    assert len(weights.layers) == cfg.num_layers
    # Qwen2 checkpoints carry q/k/v biases; the zoo's Llama and Mistral ones carry none.
    assert (weights.layers[0].qkv_bias is not None) == (cfg.model_type == "qwen2")


def test_a_qwen2_checkpoint_without_its_qkv_bias_is_refused(zoo: ZooPaths, tmp_path: Path) -> None:
    src = zoo.base("tiny-qwen2")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = read_tensors(src)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = load_model_config(tmp_path)
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_weights(tmp_path, cfg, torch.float32, "cpu")
