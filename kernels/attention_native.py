"""The native CPU path of paged decode attention (`kernels/csrc/paged_decode_cpu.cpp`): one call per layer
for the whole decode batch, K/V read in place from the paged cache. Same semantics as
`kernels.attention.paged_attention_decode`; accumulation in fp32 whatever the storage dtype."""

from __future__ import annotations

import torch

from kernels.attention_meta import AttentionMeta


def paged_attention_decode_native(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    if q.shape[0] == 0:
        return
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    torch.ops.loragate_cpu.paged_decode(
        target,
        q.contiguous(),
        k_cache.contiguous(),
        v_cache.contiguous(),
        meta.block_tables.contiguous(),
        meta.context_lens.contiguous(),
        scale,
        sliding_window or 0,
    )
    if target is not out:
        out.copy_(target)
