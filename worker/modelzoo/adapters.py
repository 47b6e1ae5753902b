"""The zoo's LoRA adapters: PEFT checkpoints of varied rank, targets and scaling for each base model.

They give the engine's multi-LoRA paths (batched kernels, adapter cache, routing) real
`adapter_config.json` + `adapter_model.safetensors` pairs to load. Each adapter covers a different
corner: ranks 8–64, attention-only, MLP-only and all-linear targets, `lora_alpha` above, equal to and
below the rank, and rsLoRA scaling. Weights are random but of controlled size: after a name-keyed
draw, each module's `lora_B` is rescaled so that the effective update `scaling·B·A` has a fixed
Frobenius norm relative to the base weight (the spec's `strength`). That is large enough to change
greedy outputs on ordinary prompts and small enough that logits keep the base model's scale,
whatever the rank, alpha or rsLoRA setting.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # peft (and transformers with it) take ~8 s to import: only where adapters are built
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

from worker.modelzoo.seeding import seeded_normal

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION + MLP

# PEFT names the only adapter of a freshly wrapped model "default".
_ADAPTER = "default"
_PEFT_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter: its rank, scaling, target modules, seed and relative strength."""

    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    seed: int
    use_rslora: bool = False
    # ‖scaling·B·A‖_F / ‖W‖_F for every targeted module.
    strength: float = 0.08

    def lora_config(self, base_name: str) -> LoraConfig:
        """The PEFT config; `base_model_name_or_path` is the zoo base name, not a build-time path."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            use_rslora=self.use_rslora,
            lora_dropout=0.0,
            bias="none",
            init_lora_weights=False,
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_name,
        )


# Strengths are small because random deep nets are chaotic: at 0.03 an adapter already changes the
# greedy continuation of nearly every prompt; these values change 30–80% of teacher-forced argmaxes
# (more on `small`, fewer on the 128-wide `tiny-qwen2`) while keeping the base logit scale.
_LLAMA_ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("qv-r8", 8, 16, ("q_proj", "v_proj"), seed=11, strength=0.1),
    AdapterSpec("attn-r16", 16, 16, ATTENTION, seed=12),
    AdapterSpec("mlp-r32", 32, 64, MLP, seed=13, strength=0.1),
    AdapterSpec("all-r64", 64, 32, ALL_LINEAR, seed=14, strength=0.06),
    AdapterSpec("qkvo-r8-rslora", 8, 8, ATTENTION, seed=15, use_rslora=True),
    AdapterSpec("gate-up-r16", 16, 32, ("gate_proj", "up_proj"), seed=16, strength=0.12),
    AdapterSpec("kv-r32", 32, 32, ("k_proj", "v_proj"), seed=17, strength=0.1),
    AdapterSpec("all-r8", 8, 16, ALL_LINEAR, seed=18, strength=0.05),
    AdapterSpec("o-down-r16", 16, 16, ("o_proj", "down_proj"), seed=19, strength=0.1),
    AdapterSpec("all-r32-rslora", 32, 16, ALL_LINEAR, seed=20, use_rslora=True, strength=0.06),
)

ADAPTER_SPECS: dict[str, tuple[AdapterSpec, ...]] = {
    "tiny": _LLAMA_ADAPTERS,
    "small": _LLAMA_ADAPTERS,
    "tiny-qwen2": (
        AdapterSpec("qv-r8", 8, 16, ("q_proj", "v_proj"), seed=21, strength=0.15),
        AdapterSpec("all-r16", 16, 32, ALL_LINEAR, seed=22, strength=0.1),
    ),
}


def init_lora(model: PeftModel, key: str, strength: float) -> None:
    """Draw every LoRA A/B from name-keyed generators, then rescale B to the target `strength`."""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or _ADAPTER not in module.lora_A:
                continue
            lora_a = _linear_weight(module.lora_A[_ADAPTER])
            lora_b = _linear_weight(module.lora_B[_ADAPTER])
            # A ~ N(0, 1/in) keeps A·x at the scale of x; B's scale is fixed by the rescale below.
            lora_a.copy_(seeded_normal(lora_a.shape, f"{key}:{name}:A", std=lora_a.shape[1] ** -0.5))
            lora_b.copy_(seeded_normal(lora_b.shape, f"{key}:{name}:B", std=1.0))
            delta = module.scaling[_ADAPTER] * (lora_b @ lora_a)
            base_weight = _linear_weight(module.get_base_layer())
            lora_b.mul_(strength * base_weight.norm() / delta.norm())


def _linear_weight(module: nn.Module) -> torch.Tensor:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"expected a Linear LoRA factor or base layer, got {type(module).__name__}")
    return module.weight


def create_adapter(base: PreTrainedModel, base_name: str, spec: AdapterSpec) -> PeftModel:
    """`spec` applied to a copy of `base` (which is left untouched), with its weights initialised."""
    from peft import get_peft_model

    copied = copy.deepcopy(base)
    # PEFT records the model's own name_or_path; a zoo name is stable, a build-time path is not.
    copied.name_or_path = base_name
    config = spec.lora_config(base_name)
    with warnings.catch_warnings():
        # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`; nothing to fix here.
        warnings.filterwarnings("ignore", message=_PEFT_DEPRECATION, category=FutureWarning)
        model = get_peft_model(copied, config)
    init_lora(model, f"{base_name}:{spec.name}:{spec.seed}", spec.strength)
    # PEFT turned the targets into a set, which would be saved in per-process hash order. The
    # PeftModel holds this very config object, so sorting it here fixes what is saved.
    config.target_modules = sorted(spec.targets)
    return model.eval()


def build_adapter(base: PreTrainedModel, base_name: str, spec: AdapterSpec, out: Path) -> Path:
    """Save adapter `spec` for `base` into `out` (adapter_config.json + adapter_model.safetensors)."""
    out.mkdir(parents=True, exist_ok=True)
    # The embeddings are never targeted; "auto" would look the base name up on the Hugging Face Hub.
    create_adapter(base, base_name, spec).save_pretrained(str(out), save_embedding_layers=False)
    # PEFT also writes a model card of placeholders; it says nothing and only adds a file to hash.
    (out / "README.md").unlink(missing_ok=True)
    return out
