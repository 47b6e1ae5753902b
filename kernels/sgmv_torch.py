"""CPU (torch) paths of the SGMV kernels: one matmul pair per segment, no per-token loops.

Segments come from `LoRABatchMeta`: a step has at most `max_loras` adapters, so the loop runs a handful
of times per projection. With a rank table, each slot's padded weights are sliced to its true rank, so a
rank-8 adapter stacked in a rank-64 buffer costs rank-8 work.
"""

from __future__ import annotations

import torch


def _segments(seg_indptr: torch.Tensor, slot_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    bounds = seg_indptr.tolist()
    return [(bounds[i], bounds[i + 1], s) for i, s in enumerate(slot_ids.tolist()) if s >= 0]


def sgmv_shrink_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    slot_ids: torch.Tensor,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    scales = scale.tolist()
    rank_list = ranks.tolist() if ranks is not None else None
    weights = lora_a[layer]
    for start, end, slot in _segments(seg_indptr, slot_ids):
        r = rank_list[slot] if rank_list is not None else weights.shape[1]
        if r == 0 or start == end:
            continue
        y[start:end, :r].addmm_(x[start:end], weights[slot, :r].t(), alpha=scales[slot])


def sgmv_expand_torch(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    slot_ids: torch.Tensor,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
) -> None:
    rank_list = ranks.tolist() if ranks is not None else None
    weights = lora_b[layer]
    out = weights.shape[1]
    for start, end, slot in _segments(seg_indptr, slot_ids):
        r = rank_list[slot] if rank_list is not None else weights.shape[2]
        if r == 0 or start == end:
            continue
        y[start:end, y_offset : y_offset + out].addmm_(v[start:end, :r], weights[slot, :, :r].t())
