"""Read a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) for a base model.

Per target module we keep A as `[num_layers, r, in]` and B as `[num_layers, out, r]` (zeros for layers
the adapter does not touch) and one scale: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA, honouring
`rank_pattern` / `alpha_pattern`. A layer whose pattern gives a different scale has the ratio folded
into its B, so kernels see one scale per (module, slot). Anything we cannot serve exactly — DoRA,
trained biases, embedding or LM-head adapters, shapes that do not match the base — is a clear error.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.config import ModelConfig

_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be loaded for this base model, with the reason."""


@dataclass(frozen=True)
class ModuleLoRA:
    a: torch.Tensor  # [num_layers, r, in]
    b: torch.Tensor  # [num_layers, out, r]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@dataclass(frozen=True)
class LoRAWeights:
    name: str
    path: Path
    modules: dict[str, ModuleLoRA]

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def _pattern(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "adapter_config.json"
    if not cfg_path.exists():
        raise AdapterError(f"{path}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_path}: invalid JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise AdapterError(f"{path}: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{path}: adapters with trained biases (bias={cfg['bias']!r}) are not supported")
    if "r" not in cfg or "lora_alpha" not in cfg:
        raise AdapterError(f"{path}: adapter_config.json lacks 'r' or 'lora_alpha'")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / "adapter_model.safetensors"
    if not weights.exists():
        raise AdapterError(f"{path}: no adapter_model.safetensors")
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises several types for corrupt files
        raise AdapterError(f"{weights}: unreadable safetensors file ({e})") from e


def load_adapter(name: str, path: Path, cfg: ModelConfig, dtype: torch.dtype) -> LoRAWeights:
    conf = _read_config(path)
    shapes = cfg.module_shapes()
    found: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"{path}: unsupported adapter tensor {key!r} (only LoRA on linear layers)")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if module not in shapes:
            raise AdapterError(f"{path}: {key}: unknown target module {module!r}")
        if layer >= cfg.num_layers:
            raise AdapterError(
                f"{path}: {key}: layer {layer}, but the base model has {cfg.num_layers} layers: "
                "made for another base model?"
            )
        found.setdefault((module, layer), {})[which] = tensor
    if not found:
        raise AdapterError(f"{path}: no LoRA weights in adapter_model.safetensors")

    modules: dict[str, ModuleLoRA] = {}
    for module in shapes:
        layers = sorted(layer for (mod, layer) in found if mod == module)
        if layers:
            modules[module] = _stack_module(path, module, layers, found, conf, cfg, dtype)
    return LoRAWeights(name=name, path=path, modules=modules)


def _stack_module(
    path: Path,
    module: str,
    layers: list[int],
    found: dict[tuple[str, int], dict[str, torch.Tensor]],
    conf: dict[str, Any],
    cfg: ModelConfig,
    dtype: torch.dtype,
) -> ModuleLoRA:
    fan_in, fan_out = cfg.module_shapes()[module]
    parent = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    pairs = []
    for layer in layers:
        ab = found[(module, layer)]
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {layer} {module} has lora_{next(iter(ab))} without its pair")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.shape != (r, fan_in) or b.shape != (fan_out, r):
            raise AdapterError(
                f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"fit the base model (expected [r, {fan_in}] / [{fan_out}, r]): made for another base model?"
            )
        name = f"model.layers.{layer}.{parent}.{module}"
        alpha = float(_pattern(conf.get("alpha_pattern") or {}, name, conf["lora_alpha"]))
        scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        pairs.append((layer, a, b, scale))
    rank = max(a.shape[0] for _, a, _, _ in pairs)
    ref_scale = pairs[0][3]
    a_stack = torch.zeros(cfg.num_layers, rank, fan_in, dtype=dtype)
    b_stack = torch.zeros(cfg.num_layers, fan_out, rank, dtype=dtype)
    for layer, a, b, scale in pairs:
        r = a.shape[0]
        a_stack[layer, :r] = a.to(dtype)
        b_stack[layer, :, :r] = b.to(dtype) * (scale / ref_scale) if scale != ref_scale else b.to(dtype)
    # In the serving dtype (a large fp32 value is inf in fp16): a NaN or inf weight makes the adapter's
    # outputs meaningless, and the bf16 kernel that adds several adapters' products in one tile multiplies
    # each adapter's B by zeros for the other adapters' rows (`kernels/csrc/linear_amx_lora.h`): 0 x inf
    # would reach them. Refused here, with the layer that has it.
    for layer, _, _, _ in pairs:
        if not (torch.isfinite(a_stack[layer]).all() and torch.isfinite(b_stack[layer]).all()):
            raise AdapterError(
                f"{path}: layer {layer} {module}: weights not finite in {dtype} (NaN or inf): a broken "
                "adapter"
            )
    return ModuleLoRA(a=a_stack, b=b_stack, scale=ref_scale)
