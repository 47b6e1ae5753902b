"""`sgmv_group` (q/k/v or gate/up adapters on one input, in one call) against the float64 reference of
shrink-then-expand per projection, on the torch loop and the native fused kernel (`cpu_backend`).

Weights past each slot's rank are NaN, so a kernel that reads them fails; output columns outside the
projections' slices, rows without an adapter and rows of slots that do not adapt a projection must come
back bit-exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import LoRABatchMeta, LoRAGroup, LoRAProjection, sgmv_expand, sgmv_group, sgmv_shrink
from kernels.backend import BACKEND_ENV
from kernels.reference import sgmv_expand_ref, sgmv_shrink_ref
from tests.kernels.kernel_testing import POPULARITIES, TOLERANCE, lora_stack, rel_err, token_slots

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYER = 1
# Per projection: output width and per-slot ranks (0: that slot's adapter leaves the projection alone).
PROJECTIONS = ((48, [8, 16, 0, 4, 8]), (16, [8, 0, 0, 4, 16]), (16, [8, 16, 2, 0, 16]))


def group_case(
    popularity: str, dtype: torch.dtype, seed: int, *, transposed_b: bool = False, hidden: int = 40
) -> tuple[list[int], torch.Tensor, torch.Tensor, LoRAGroup]:
    """(token slots, x, poisoned y, group): three projections side by side from column 4 of y."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 11, (9,), generator=gen).tolist()
    slots = token_slots(popularity, seq_lens, len(PROJECTIONS[0][1]), gen, base_share=0.25)
    meta = LoRABatchMeta.from_token_slots(slots)
    projections, offset = [], 4
    for out, ranks in PROJECTIONS:
        stack = lora_stack(2, ranks, hidden, out, dtype, gen, max_rank=16, padding=float("nan"))
        b = stack.b.transpose(2, 3).contiguous().transpose(2, 3) if transposed_b else stack.b
        rank_t = torch.tensor(ranks, dtype=torch.int64)
        module_meta = meta.for_module(ranks, stack.scale.tolist())
        projections.append(LoRAProjection(stack.a, b, stack.scale, rank_t, offset, module_meta))
        offset += out
    x = torch.randn(len(slots), hidden, generator=gen).to(dtype)
    y = torch.randn(len(slots), offset + 6, generator=gen).to(dtype)
    return slots, x, y, LoRAGroup(tuple(projections), meta)


def reference(slots: list[int], x: torch.Tensor, y: torch.Tensor, group: LoRAGroup) -> torch.Tensor:
    """float64: each projection's shrink (rounded to x's dtype, as the kernels store v), then expand."""
    out = y.double()
    for p in group.projections:
        ranks = p.ranks.tolist()
        v = sgmv_shrink_ref(x, p.a, slots, LAYER, p.scale, ranks).to(x.dtype)
        out = sgmv_expand_ref(out, v, p.b, slots, LAYER, p.y_offset, ranks)
    return out


def untouched(slots: list[int], y: torch.Tensor, group: LoRAGroup) -> torch.Tensor:
    mask = torch.ones(y.shape, dtype=torch.bool)
    for p in group.projections:
        n = p.b.shape[2]
        for t, s in enumerate(slots):
            if s >= 0 and int(p.ranks[s]) > 0:
                mask[t, p.y_offset : p.y_offset + n] = False
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("transposed_b", [False, True], ids=["b-rows", "b-transposed"])
def test_group_matches_shrink_then_expand_per_projection(
    popularity: str, dtype: torch.dtype, transposed_b: bool, cpu_backend: str
) -> None:
    for seed in range(3):
        slots, x, y0, group = group_case(popularity, dtype, seed, transposed_b=transposed_b)
        y = y0.clone()
        sgmv_group(y, x, group, layer=LAYER)
        assert rel_err(y, reference(slots, x, y0, group)) < TOLERANCE[dtype]
        keep = untouched(slots, y0, group)
        assert torch.equal(y[keep], y0[keep])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_group_equals_native_shrink_and_expand_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernel computes the same sums in the same order as the two separate ones."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    _, x, y0, group = group_case("zipf", dtype, 5, transposed_b=True, hidden=96)
    fused, separate = y0.clone(), y0.clone()
    sgmv_group(fused, x, group, layer=LAYER)
    for p in group.projections:
        v = x.new_zeros(x.shape[0], p.a.shape[2])
        sgmv_shrink(v, x, p.a, p.meta, layer=LAYER, scale=p.scale, ranks=p.ranks)
        sgmv_expand(separate, v, p.b, p.meta, layer=LAYER, y_offset=p.y_offset, ranks=p.ranks)
    assert torch.equal(fused, separate)


def test_native_group_refuses_a_projection_outside_y(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    _, x, y0, group = group_case("uniform", torch.float32, 2)
    last = group.projections[-1]
    bad = LoRAGroup((*group.projections[:-1], replace(last, y_offset=y0.shape[1] - 4)), group.meta)
    with pytest.raises(RuntimeError, match="output slice out of y"):
        sgmv_group(y0.clone(), x, bad, layer=LAYER)
    with pytest.raises(RuntimeError, match="layer out of range"):
        sgmv_group(y0.clone(), x, group, layer=2)
