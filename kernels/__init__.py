"""Kernels of the worker's hot path: multi-LoRA SGMV and paged attention (imports only torch/triton)."""

from kernels.attention import paged_attention_decode, paged_attention_prefill, write_kv
from kernels.bgmv import bgmv_expand, bgmv_shrink
from kernels.lora_meta import LoRABatchMeta
from kernels.sgmv import sgmv_expand, sgmv_shrink

__all__ = [
    "LoRABatchMeta",
    "bgmv_expand",
    "bgmv_shrink",
    "paged_attention_decode",
    "paged_attention_prefill",
    "sgmv_expand",
    "sgmv_shrink",
    "write_kv",
]
