"""Llama (`LlamaForCausalLM`, model_type `llama`): the reference family; every layer attends in full.

Its checkpoints may hold biases (`attention_bias`, `mlp_bias`), which the loader takes when present.
"""

from __future__ import annotations

from types import MappingProxyType

from worker.models.family import ModelFamily

LLAMA = ModelFamily(
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    defaults=MappingProxyType({"max_position_embeddings": 2048, "rms_norm_eps": 1e-6}),
)
