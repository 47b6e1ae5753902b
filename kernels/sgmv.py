"""Segmented gather matrix-vector (SGMV) LoRA kernels, Punica-style: many adapters in one batch.

Tokens of a step are grouped into segments, one adapter slot per segment (slot -1: no adapter).
A LoRA-wrapped projection computes `y += scale * (x @ A[slot]^T) @ B[slot]^T` per segment in two launches:
`sgmv_shrink` (x → v, width = rank) then `sgmv_expand` (v → y, possibly into a column slice of a fused
qkv / gate-up output). Adapter weights are stacked per layer and slot, padded to the largest rank; an
optional rank table lets a backend skip the padding. The backend follows the tensors' device (see
`kernels.backend`): the Triton kernels of `kernels.sgmv_triton` on CUDA; on a CPU the native kernels of
`kernels.sgmv_native` where they build, else the torch loop of `kernels.sgmv_torch`. The segments come
in the step's `LoRABatchMeta`, built once per step and shared by every projection of every layer.
"""

from __future__ import annotations

import torch

from kernels import sgmv_native
from kernels.backend import use_native, use_triton
from kernels.lora_meta import LoRABatchMeta, LoRAGroup
from kernels.sgmv_torch import sgmv_expand_torch, sgmv_shrink_torch


def sgmv_shrink(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    """Shrink: project each segment's inputs onto its adapter's A, scaled.

    Semantics:
        for i with slot_ids[i] >= 0, s = seg_indptr (both from `meta`):
            y[s[i]:s[i+1], :r] += scale[slot_ids[i]] * x[s[i]:s[i+1]] @ lora_a[layer, slot_ids[i], :r].T
        where r = ranks[slot_ids[i]] (or R). Rows of segments with slot -1 are left as they are.

    Args:
        y: Shape `[T, R]`. Output, updated in place (callers zero it first).
        x: Shape `[T, H_in]`. Input activations, segments contiguous.
        lora_a: Shape `[L, S, R, H_in]`. Stacked A weights per layer and slot, zero-padded to rank R.
        meta: The step's segments (`LoRABatchMeta`): `seg_indptr` `[num_segments + 1]` and `slot_ids`
            `[num_segments]` (int64, on x's device; slot -1 = no adapter) and the same on the host.
        layer: Layer index into `lora_a`.
        scale: Shape `[S]`. Per-slot LoRA scaling (alpha / r, or alpha / sqrt(r) with rsLoRA).
        ranks: Shape `[S]`, int64, optional. True rank per slot (0 = this module is not adapted).
    """
    if use_triton(x):
        from kernels.sgmv_triton import sgmv_shrink_triton

        sgmv_shrink_triton(y, x, lora_a, meta, layer=layer, scale=scale, ranks=ranks)
    elif use_native(x):
        sgmv_native.sgmv_shrink_native(y, x, lora_a, meta, layer=layer, scale=scale, ranks=ranks)
    else:
        sgmv_shrink_torch(y, x, lora_a, meta, layer=layer, scale=scale, ranks=ranks)


def sgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
) -> None:
    """Expand: add each segment's rank-space activations times its adapter's B into a column slice of y.

    Semantics:
        for i with slot_ids[i] >= 0, s = seg_indptr (both from `meta`), o = y_offset, N = lora_b.shape[2]:
            y[s[i]:s[i+1], o:o+N] += v[s[i]:s[i+1], :r] @ lora_b[layer, slot_ids[i], :, :r].T

    Args:
        y: Shape `[T, H_out_total]`. Output, updated in place (e.g. the fused qkv projection output).
        v: Shape `[T, R]`. The shrink output (already scaled).
        lora_b: Shape `[L, S, N, R]`. Stacked B weights per layer and slot, zero-padded to rank R.
        meta: The step's segments (`LoRABatchMeta`), as for `sgmv_shrink`.
        layer: Layer index into `lora_b`.
        y_offset: First column of the slice of `y` this projection writes (q/k/v or gate/up part).
        ranks: Shape `[S]`, int64, optional. True rank per slot (0 = not adapted).
    """
    if use_triton(v):
        from kernels.sgmv_triton import sgmv_expand_triton

        sgmv_expand_triton(y, v, lora_b, meta, layer=layer, y_offset=y_offset, ranks=ranks)
    elif use_native(v):
        sgmv_native.sgmv_expand_native(y, v, lora_b, meta, layer=layer, y_offset=y_offset, ranks=ranks)
    else:
        sgmv_expand_torch(y, v, lora_b, meta, layer=layer, y_offset=y_offset, ranks=ranks)


def sgmv_group(y: torch.Tensor, x: torch.Tensor, group: LoRAGroup, *, layer: int) -> None:
    """Shrink and expand of every projection of a group (q/k/v, or gate/up, or one alone) on one input.

    Semantics:
        for p in group.projections:
            v = zeros(T, R_p);  sgmv_shrink(v, x, p.a, p.meta, layer=layer, scale=p.scale, ranks=p.ranks)
            sgmv_expand(y, v, p.b, p.meta, layer=layer, y_offset=p.y_offset, ranks=p.ranks)
        (v rounded to x's dtype between the two, as there.) The native CPU kernel does it in one call,
        v never leaving the thread; the Triton one in two launches (all shrinks, then all expands); the
        torch path runs exactly the loop above.

    Args:
        y: Shape `[T, H_out_total]`. The fused output, updated in place; rows contiguous.
        x: Shape `[T, H_in]`. The projections' shared input, segments contiguous.
        group: The step's projections (`LoRAGroup`): weights `[L, S, R, H_in]` / `[L, S, N, R]`, per-slot
            scale and rank tables `[S]`, output offsets, and the step's segments.
        layer: Layer index into every projection's weights.
    """
    if use_triton(x):
        from kernels.sgmv_group_triton import sgmv_group_triton

        sgmv_group_triton(y, x, group, layer=layer)
        return
    if use_native(x):
        sgmv_native.sgmv_group_native(y, x, group, layer=layer)
        return
    for p in group.projections:
        v = x.new_zeros(x.shape[0], p.a.shape[2])
        sgmv_shrink(v, x, p.a, p.meta, layer=layer, scale=p.scale, ranks=p.ranks)
        sgmv_expand(y, v, p.b, p.meta, layer=layer, y_offset=p.y_offset, ranks=p.ranks)
