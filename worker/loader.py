"""Load a local Hugging Face Llama-family checkpoint (safetensors, sharded or not) into fused weights.

q/k/v are fused into one `[q + 2·kv, hidden]` matrix and gate/up into one `[2·inter, hidden]` matrix, so
each layer runs two big matmuls where the checkpoint has five. Tensor names come from the model's family
(`worker.models`); biases are whatever the checkpoint holds, except that a family's required biases
(Qwen2's q/k/v) must be there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.linear import LinearWeight
from kernels.lm_head import LMHead
from worker.config import ModelConfig, ModelLoadError
from worker.models import family_named


@dataclass(slots=True)
class LayerWeights:
    """One layer's tensors; the four projections as loaded, then packed by `worker.model.pack_weights`."""

    input_norm: torch.Tensor
    qkv: LinearWeight
    qkv_bias: torch.Tensor | None
    o: LinearWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: LinearWeight
    gate_up_bias: torch.Tensor | None
    down: LinearWeight
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: LMHead  # a tensor as loaded; `worker.model.pack_weights` may pack it for the native CPU kernel


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

    def fused_bias(self, names: list[str], sizes: list[int], required: list[bool]) -> torch.Tensor | None:
        present = [n in self.tensors for n in names]
        for name, there, needed in zip(names, present, required, strict=True):
            if needed and not there:
                raise ModelLoadError(f"{self.model_dir}: missing tensor {name} (the family has this bias)")
        if not any(present):
            return None
        return torch.cat(
            [
                self.take(n, (s,)) if p else torch.zeros(s, dtype=self.dtype, device=self.device)
                for n, s, p in zip(names, sizes, present, strict=True)
            ]
        )


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: str) -> ModelWeights:
    family = family_named(cfg.model_type)
    names = family.weights
    t = _Taker(read_tensors(model_dir), model_dir, dtype, device)
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    qkv_modules, gate_up_modules = ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]
    qkv_required = [m in family.required_biases for m in qkv_modules]
    gate_up_required = [m in family.required_biases for m in gate_up_modules]
    layers = []
    for i in range(cfg.num_layers):
        p = names.prefix(i)
        attn = [names.module(i, m) for m in qkv_modules]
        mlp = [names.module(i, m) for m in gate_up_modules]
        o, down = names.module(i, "o_proj"), names.module(i, "down_proj")
        layers.append(
            LayerWeights(
                input_norm=t.take(p + names.input_norm, (h,)),
                qkv=t.fused([n + ".weight" for n in attn], [(q, h), (kv, h), (kv, h)]),
                qkv_bias=t.fused_bias([n + ".bias" for n in attn], [q, kv, kv], qkv_required),
                o=t.take(o + ".weight", (h, q)),
                o_bias=t.maybe(o + ".bias", (h,)),
                post_norm=t.take(p + names.post_norm, (h,)),
                gate_up=t.fused([n + ".weight" for n in mlp], [(inter, h), (inter, h)]),
                gate_up_bias=t.fused_bias([n + ".bias" for n in mlp], [inter, inter], gate_up_required),
                down=t.take(down + ".weight", (h, inter)),
                down_bias=t.maybe(down + ".bias", (h,)),
            )
        )
    embed = t.take(names.embed, (cfg.vocab_size, h))
    norm = t.take(names.final_norm, (h,))
    head = t.maybe(names.lm_head, (cfg.vocab_size, h))
    if head is None:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(f"{model_dir}: missing tensor {names.lm_head}")
        head = embed
    leftovers = [k for k in t.tensors if not any(part in k for part in names.ignored)]
    if leftovers:
        raise ModelLoadError(f"{model_dir}: unexpected tensors in checkpoint: {leftovers[:5]}")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=head)
