"""Load a local Hugging Face Llama-family checkpoint (safetensors, sharded or not) into fused weights.

q/k/v are fused into one `[q + 2·kv, hidden]` matrix and gate/up into one `[2·inter, hidden]` matrix, so
each layer runs two big matmuls where the checkpoint has five. Biases are whatever the checkpoint holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from worker.config import ModelConfig, ModelLoadError


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    return files


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _shard_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[key] = f.get_tensor(key)
    return tensors


class _Taker:
    """Pops named tensors, checks shapes and casts; reports what is missing or malformed by name."""

    def __init__(self, tensors: dict[str, torch.Tensor], model_dir: Path, dtype: torch.dtype, device: str):
        self.tensors, self.model_dir, self.dtype, self.device = tensors, model_dir, dtype, device

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.model_dir}: missing tensor {name}")
        t = self.tensors.pop(name)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{self.model_dir}: {name} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=self.device, dtype=self.dtype)

    def maybe(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, shape) if name in self.tensors else None

    def fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self.take(n, s) for n, s in zip(names, shapes, strict=True)]).contiguous()

    def fused_bias(self, names: list[str], sizes: list[int]) -> torch.Tensor | None:
        present = [n in self.tensors for n in names]
        if not any(present):
            return None
        return torch.cat(
            [
                self.take(n, (s,)) if p else torch.zeros(s, dtype=self.dtype, device=self.device)
                for n, s, p in zip(names, sizes, present, strict=True)
            ]
        )


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: str) -> ModelWeights:
    t = _Taker(read_tensors(model_dir), model_dir, dtype, device)
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
        mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
        layers.append(
            LayerWeights(
                input_norm=t.take(p + "input_layernorm.weight", (h,)),
                qkv=t.fused([n + ".weight" for n in attn], [(q, h), (kv, h), (kv, h)]),
                qkv_bias=t.fused_bias([n + ".bias" for n in attn], [q, kv, kv]),
                o=t.take(p + "self_attn.o_proj.weight", (h, q)),
                o_bias=t.maybe(p + "self_attn.o_proj.bias", (h,)),
                post_norm=t.take(p + "post_attention_layernorm.weight", (h,)),
                gate_up=t.fused([n + ".weight" for n in mlp], [(inter, h), (inter, h)]),
                gate_up_bias=t.fused_bias([n + ".bias" for n in mlp], [inter, inter]),
                down=t.take(p + "mlp.down_proj.weight", (h, inter)),
                down_bias=t.maybe(p + "mlp.down_proj.bias", (h,)),
            )
        )
    embed = t.take("model.embed_tokens.weight", (cfg.vocab_size, h))
    norm = t.take("model.norm.weight", (h,))
    head = t.maybe("lm_head.weight", (cfg.vocab_size, h))
    if head is None:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(f"{model_dir}: missing tensor lm_head.weight")
        head = embed
    leftovers = [k for k in t.tensors if "rotary_emb" not in k]
    if leftovers:
        raise ModelLoadError(f"{model_dir}: unexpected tensors in checkpoint: {leftovers[:5]}")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=head)
