"""The zoo's base models: small, randomly initialised Llama, Qwen2 and Mistral checkpoints.

They exist so the engine, its loaders and the benchmarks have real Hugging Face checkpoints to read
without any download. The weights are random but chosen to behave like a language model in the ways
the tests need: the next token depends on the whole context, logits are not flat, and greedy
decoding does not collapse at once into one repeated token. HF's default `initializer_range` of 0.02
fails at these sizes: logits have std ≈ 0.3, the median top-1/top-2 gap is ≈ 0.06, greedy decoding
repeats a token after one or two steps, and near-uniform attention makes the logits a blur of the
whole context (swapping the last token leaves them at cosine ≈ 0.95). The Llama specs use 0.08 and
the 128-wide ones 0.1: logit std ≈ 0.9–1.8, median gap ≈ 0.15–0.35, and both the last token and the
prefix move the logits. Every parameter is drawn from its own name-keyed generator (see `seeding`),
biases are non-zero and norm weights are jittered around 1, so a loader that drops a bias or a norm
weight produces visibly different outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from worker.modelzoo.base_specs import BASE_SPECS as BASE_SPECS
from worker.modelzoo.base_specs import BaseSpec, Family
from worker.modelzoo.base_specs import base_spec as base_spec
from worker.modelzoo.seeding import seeded_normal
from worker.modelzoo.tokenizer import BOS, EOS, IM_END, PAD, qwen2_pipeline

# Norm weights of exactly 1 would hide a loader that forgets them.
NORM_JITTER = 0.1


_CONFIG_CLASSES: dict[Family, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
}
_MODEL_CLASSES: dict[Family, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "mistral": MistralForCausalLM,
}


def model_config(spec: BaseSpec, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config for `spec`, sized to `tokenizer`'s vocabulary."""
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=token_id(tokenizer, BOS),
        eos_token_id=token_id(tokenizer, EOS),
        pad_token_id=token_id(tokenizer, PAD),
    )
    if spec.family == "mistral":
        # Full attention here: a window would change the zoo's artefacts (see make.ZOO_VERSION). The
        # engine's window tests write windowed copies of this config (tests/worker/test_engine_parity.py).
        common["sliding_window"] = None
    return _CONFIG_CLASSES[spec.family](**common)


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one token of `tokenizer`'s vocabulary."""
    value = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(value, int):
        raise TypeError(f"{token!r} maps to {value!r}, not a single id")
    return value


def init_weights(model: PreTrainedModel, spec: BaseSpec) -> None:
    """Overwrite every parameter of `model` with name-keyed random values (see module docstring)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = f"{spec.name}:{spec.seed}:{name}"
            if name.endswith(".bias"):
                value = seeded_normal(param.shape, key, std=spec.initializer_range)
            elif param.dim() == 1:
                value = seeded_normal(param.shape, key, std=NORM_JITTER, mean=1.0)
            else:
                value = seeded_normal(param.shape, key, std=spec.initializer_range)
            param.copy_(value)


def generation_config(tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Stop on either end-of-text or end-of-turn, as chat-tuned checkpoints do."""
    return GenerationConfig(
        bos_token_id=token_id(tokenizer, BOS),
        eos_token_id=[token_id(tokenizer, EOS), token_id(tokenizer, IM_END)],
        pad_token_id=token_id(tokenizer, PAD),
    )


def create_base(spec: BaseSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The randomly initialised fp32 model for `spec`, in eval mode, not yet saved."""
    config = model_config(spec, tokenizer)
    model = _MODEL_CLASSES[spec.family](config)
    init_weights(model, spec)
    model.generation_config = generation_config(tokenizer)
    return model.float().eval()


def build_base(spec: BaseSpec, tokenizer: PreTrainedTokenizerBase, out: Path) -> PreTrainedModel:
    """Save the model for `spec` (safetensors, fp32), its generation config and `tokenizer` into `out`.

    A qwen2 model gets the tokenizer behind Qwen2's pre-tokenizer (see `tokenizer.qwen2_pipeline`).

    Returns the saved model, so adapters can be built on it without reading it back.
    """
    out.mkdir(parents=True, exist_ok=True)
    model = create_base(spec, tokenizer)
    model.save_pretrained(out)
    if spec.family == "qwen2" and isinstance(tokenizer, PreTrainedTokenizerFast):
        tokenizer = qwen2_pipeline(tokenizer)
    tokenizer.save_pretrained(out)
    return model
