"""CPU (torch) path of the BGMV kernels: group the tokens by slot once, then run the SGMV segment loop.

Tokens already contiguous per slot (the engine's layout) go straight to the segment loop. Otherwise a
stable sort by slot gathers each adapter's rows (`index_select`), the loop writes a compact result and
`index_add_` scatters it back: two row copies per call instead of one matmul per token. Tokens with slot
-1 sort first and are dropped before the gather.
"""

from __future__ import annotations

import torch

from kernels.sgmv_torch import Segment, expand_segments, shrink_segments


def group_tokens(token_slots: torch.Tensor) -> tuple[torch.Tensor | None, list[Segment]]:
    """`(order, segments)`: rows `order[start:end]` use `slot`; `order` is None when no reordering is needed
    (segments then index the tokens directly)."""
    slots, counts = torch.unique_consecutive(token_slots, return_counts=True)
    slot_list = slots.tolist()
    if len(set(slot_list)) == len(slot_list):
        bounds = [0, *counts.cumsum(0).tolist()]
        return None, [(bounds[i], bounds[i + 1], s) for i, s in enumerate(slot_list) if s >= 0]
    sorted_slots, order = torch.sort(token_slots, stable=True)
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    slot_list, count_list = slots.tolist(), counts.tolist()
    if slot_list[0] < 0:
        order = order[count_list[0] :]
        slot_list, count_list = slot_list[1:], count_list[1:]
    bounds = [0]
    for c in count_list:
        bounds.append(bounds[-1] + c)
    return order, [(bounds[i], bounds[i + 1], s) for i, s in enumerate(slot_list)]


def bgmv_shrink_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    order, segments = group_tokens(token_slots)
    if order is None:
        shrink_segments(y, x, lora_a[layer], segments, scale, ranks)
        return
    rows = y.new_zeros(order.shape[0], y.shape[1])
    shrink_segments(rows, x.index_select(0, order), lora_a[layer], segments, scale, ranks)
    y.index_add_(0, order, rows)


def bgmv_expand_torch(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
) -> None:
    out = y.narrow(1, y_offset, lora_b.shape[2])
    order, segments = group_tokens(token_slots)
    if order is None:
        expand_segments(out, v, lora_b[layer], segments, ranks)
        return
    rows = out.new_zeros(order.shape[0], out.shape[1])
    expand_segments(rows, v.index_select(0, order), lora_b[layer], segments, ranks)
    out.index_add_(0, order, rows)
