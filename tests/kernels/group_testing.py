"""The `sgmv_group` tests' inputs (`tests/kernels/test_sgmv_group*.py`): three projections of one fused
output, their float64 reference and the elements they must leave alone."""

from __future__ import annotations

import torch

from kernels import LoRABatchMeta, LoRAGroup, LoRAProjection
from kernels.reference import sgmv_expand_ref, sgmv_shrink_ref
from tests.kernels.kernel_testing import lora_stack, token_slots

LAYER = 1
# Per projection: output width and per-slot ranks (0: that slot's adapter leaves the projection alone).
PROJECTIONS = ((48, [8, 16, 0, 4, 8]), (16, [8, 0, 0, 4, 16]), (16, [8, 16, 2, 0, 16]))


def group_case(
    popularity: str,
    dtype: torch.dtype,
    seed: int,
    *,
    transposed_b: bool = False,
    hidden: int = 40,
    device: str = "cpu",
    projections: tuple[tuple[int, list[int]], ...] = PROJECTIONS,
) -> tuple[list[int], torch.Tensor, torch.Tensor, LoRAGroup]:
    """(token slots, x, poisoned y, group): `projections` (output width, per-slot ranks) side by side from
    column 4 of y, drawn on the CPU and placed on `device`."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 11, (9,), generator=gen).tolist()
    slots = token_slots(popularity, seq_lens, len(projections[0][1]), gen, base_share=0.25)
    meta = LoRABatchMeta.from_token_slots(slots, device)
    max_rank = max(16, *(r for _, ranks in projections for r in ranks))
    made, offset = [], 4
    for out, ranks in projections:
        stack = lora_stack(2, ranks, hidden, out, dtype, gen, max_rank=max_rank, padding=float("nan"))
        b = stack.b.transpose(2, 3).contiguous().transpose(2, 3) if transposed_b else stack.b
        rank_t = torch.tensor(ranks, dtype=torch.int64, device=device)
        module_meta = meta.for_module(ranks, stack.scale.tolist())
        a, b, scale = stack.a.to(device), b.to(device), stack.scale.to(device)
        made.append(LoRAProjection(a, b, scale, rank_t, offset, module_meta))
        offset += out
    x = torch.randn(len(slots), hidden, generator=gen).to(dtype)
    y = torch.randn(len(slots), offset + 6, generator=gen).to(dtype)
    return slots, x.to(device), y.to(device), LoRAGroup(tuple(made), meta)


def reference(
    slots: list[int], x: torch.Tensor, y: torch.Tensor, group: LoRAGroup, layer: int = LAYER
) -> torch.Tensor:
    """float64: each projection's shrink (rounded to x's dtype, as the kernels store v), then expand."""
    out, x = y.double().cpu(), x.cpu()
    for p in group.projections:
        ranks = p.ranks.tolist()
        v = sgmv_shrink_ref(x, p.a.cpu(), slots, layer, p.scale.cpu(), ranks).to(x.dtype)
        out = sgmv_expand_ref(out, v, p.b.cpu(), slots, layer, p.y_offset, ranks)
    return out


def untouched(slots: list[int], y: torch.Tensor, group: LoRAGroup) -> torch.Tensor:
    mask = torch.ones(y.shape, dtype=torch.bool, device=y.device)
    for p in group.projections:
        n = p.b.shape[2]
        for t, s in enumerate(slots):
            if s >= 0 and int(p.ranks[s]) > 0:
                mask[t, p.y_offset : p.y_offset + n] = False
    return mask
