"""Batched gather matrix-vector (BGMV) LoRA kernels, Punica-style: every token names its own adapter slot.

The decode counterpart of `kernels.sgmv`: same semantics per token, no segment metadata, tokens in any
slot order. On a GPU it is the faster choice for decode-only steps, where SGMV segments are a few rows
and `tl.dot`'s 16-row tiles would mostly multiply padding. On the CPU it groups the tokens on every
call (10-20 µs) and runs the SGMV segment loop, so a CPU engine whose batch is already grouped by slot
should call `kernels.sgmv` with the step's `LoRABatchMeta` instead. The backend follows the tensors'
device (see `kernels.backend`).
"""

from __future__ import annotations

import torch

from kernels.backend import use_triton
from kernels.bgmv_torch import bgmv_expand_torch, bgmv_shrink_torch


def bgmv_shrink(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    """Shrink per token: project each token's input onto its own adapter's A, scaled.

    Semantics:
        for t with token_slots[t] = s >= 0:
            y[t, :r] += scale[s] * x[t] @ lora_a[layer, s, :r].T,  r = ranks[s] (or R)
        Rows of tokens with slot -1 are left as they are.

    Args:
        y: Shape `[T, R]`. Output, updated in place (callers zero it first).
        x: Shape `[T, H_in]`. Input activations, one row per token, any slot order.
        lora_a: Shape `[L, S, R, H_in]`. Stacked A weights per layer and slot, zero-padded to rank R.
        token_slots: Shape `[T]`, int64. Adapter slot of each token; -1 = no adapter
            (`LoRABatchMeta.token_slots`).
        layer: Layer index into `lora_a`.
        scale: Shape `[S]`. Per-slot LoRA scaling.
        ranks: Shape `[S]`, int64, optional. True rank per slot (0 = this module is not adapted).
    """
    if use_triton(x):
        from kernels.bgmv_triton import bgmv_shrink_triton

        bgmv_shrink_triton(y, x, lora_a, token_slots, layer, scale, ranks)
    else:
        bgmv_shrink_torch(y, x, lora_a, token_slots, layer, scale, ranks)


def bgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
) -> None:
    """Expand per token: add each token's rank-space activations times its adapter's B into a column
    slice of y.

    Semantics:
        for t with token_slots[t] = s >= 0, o = y_offset, N = lora_b.shape[2]:
            y[t, o:o+N] += v[t, :r] @ lora_b[layer, s, :, :r].T,  r = ranks[s] (or R)

    Args:
        y: Shape `[T, H_out_total]`. Output, updated in place (e.g. the fused qkv projection output).
        v: Shape `[T, R]`. The shrink output (already scaled).
        lora_b: Shape `[L, S, N, R]`. Stacked B weights per layer and slot, zero-padded to rank R.
        token_slots: Shape `[T]`, int64. Adapter slot of each token; -1 = no adapter.
        layer: Layer index into `lora_b`.
        y_offset: First column of the slice of `y` this projection writes.
        ranks: Shape `[S]`, int64, optional. True rank per slot (0 = not adapted).
    """
    if use_triton(v):
        from kernels.bgmv_triton import bgmv_expand_triton

        bgmv_expand_triton(y, v, lora_b, token_slots, layer, y_offset, ranks)
    else:
        bgmv_expand_torch(y, v, lora_b, token_slots, layer, y_offset, ranks)
