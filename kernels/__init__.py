"""Kernels of the worker's hot path: multi-LoRA SGMV and paged attention (imports only torch/triton).

Each entry point takes its tensors (output first, updated in place) and one per-step metadata object
(`LoRABatchMeta`, `AttentionMeta`) that every layer shares; per-layer scalars are keyword-only.
"""

from kernels.attention import paged_attention_decode, paged_attention_prefill, rope_write_kv, write_kv
from kernels.attention_meta import AttentionMeta
from kernels.glue import add_rms_norm, rope_, silu_mul
from kernels.linear import linear, pack_linear_weight
from kernels.lm_head import PackedLMHead, lm_head_argmax, lm_head_logits, pack_lm_head
from kernels.lora_meta import LoRABatchMeta, LoRAGroup, LoRAProjection
from kernels.sgmv import sgmv_expand, sgmv_group, sgmv_shrink

__all__ = [
    "AttentionMeta",
    "LoRABatchMeta",
    "LoRAGroup",
    "LoRAProjection",
    "PackedLMHead",
    "add_rms_norm",
    "linear",
    "lm_head_argmax",
    "lm_head_logits",
    "pack_linear_weight",
    "pack_lm_head",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rope_",
    "rope_write_kv",
    "sgmv_expand",
    "sgmv_group",
    "sgmv_shrink",
    "silu_mul",
    "write_kv",
]
