"""`sgmv_group` (q/k/v or gate/up adapters on one input, in one call) against the float64 reference of
shrink-then-expand per projection, on the torch loop and the native fused kernel (`cpu_backend`).

Weights past each slot's rank are NaN, so a kernel that reads them fails; output columns outside the
projections' slices, rows without an adapter and rows of slots that do not adapt a projection must come
back bit-exact. Where the CPU has AMX or AVX512-BF16, the native kernel's bf16 path reads B in rank pairs
(`rank_pairs`, kept by the adapter cache beside B): tested against the same reference.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from kernels import LoRABatchMeta, LoRAGroup, sgmv_expand, sgmv_group, sgmv_shrink
from kernels.backend import BACKEND_ENV
from kernels.lora_meta import LoRAProjection
from kernels.sgmv_native import amx_ready, bf16_pairs_ready, rank_pairs, slot_pairs
from tests.kernels.group_testing import LAYER, group_case, reference, untouched
from tests.kernels.kernel_testing import POPULARITIES, TOLERANCE, rel_err

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_plan_made_once_serves_every_layer(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's plan (made at the group's first call and kept by it) serves every layer's call, each
    layer reading its own weights."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    slots, x, y0, group = group_case("zipf", dtype, 3, transposed_b=True)
    plan = group.native_plan
    for layer in (0, 1, 0):
        y = y0.clone()
        sgmv_group(y, x, group, layer=layer)
        assert rel_err(y, reference(slots, x, y0, group, layer=layer)) < TOLERANCE[dtype]
        assert torch.equal(y[untouched(slots, y0, group)], y0[untouched(slots, y0, group)])
    assert group.native_plan is plan


def test_native_plan_holds_the_weights_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan keeps its group's stacks alive: run after the group and its tensors are gone, it still
    reads the weights it was made from (freed, their memory would be reused by the allocations below)."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    slots, x, y0, group = group_case("uniform", torch.float32, 4)
    want = reference(slots, x, y0, group)
    plan = group.native_plan
    del group
    gc.collect()
    scratch = [torch.full((16, 8, 64), float("nan")) for _ in range(8)]  # would take the freed blocks
    y = y0.clone()
    torch.ops.loragate_cpu.sgmv_group_run(y, x, plan, LAYER)
    assert rel_err(y, want) < TOLERANCE[torch.float32]
    assert len(scratch) == 8


def test_native_run_refuses_anything_but_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a plan made by `sgmv_group_plan` is run: not a copy of its bytes, not zeros, not another dtype;
    and a plan is run only on inputs it fits."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    _, x, y0, group = group_case("uniform", torch.float32, 2)
    plan = group.native_plan
    run = torch.ops.loragate_cpu.sgmv_group_run
    fakes = (
        plan.clone(),
        torch.zeros_like(plan),
        plan.view(torch.int8),
        torch.zeros(plan.numel() + 8, dtype=plan.dtype)[8:],
    )
    for fake in fakes:
        with pytest.raises(RuntimeError, match="not a plan made by sgmv_group_plan"):
            run(y0.clone(), x, fake, LAYER)
    with pytest.raises(RuntimeError, match="bad segment"):
        run(y0[:-1].clone(), x[:-1], plan, LAYER)  # fewer rows than the step's segments cover
    with pytest.raises(RuntimeError, match="as long as x's"):
        run(y0.clone(), torch.cat([x, x], 1), plan, LAYER)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        run(y0.double(), x.double(), plan, LAYER)
    run(y0.clone(), x, plan, LAYER)  # the real one still runs


def test_rank_pairs_puts_two_consecutive_ranks_of_16_outputs_in_each_row() -> None:
    b = torch.randn(2, 3, 48, 5)  # [L, S, out, R], an odd rank
    pairs = rank_pairs(b.transpose(2, 3).contiguous().transpose(2, 3))  # any strides
    assert pairs.shape == (2, 3, 3, 3, 32) and pairs.is_contiguous()
    o, p, e = torch.meshgrid(torch.arange(48), torch.arange(3), torch.arange(2), indexing="ij")
    rank = 2 * p + e
    want = torch.where(rank < 5, b[:, :, o, rank.clamp(max=4)], 0.0)
    assert torch.equal(pairs[:, :, o // 16, p, 2 * (o % 16) + e], want)


def test_slot_pairs_packs_each_slots_own_ranks_densely() -> None:
    b = torch.randn(2, 3, 32, 8)  # [L, S, out, R]: slots of rank 5, 0 and 8
    pairs = slot_pairs(b, [5, 0, 8])
    assert pairs.shape == (2, 3, 2, 4, 32) and pairs.is_contiguous()
    flat = pairs.view(2, 3, -1)
    dense = rank_pairs(b[:, 0, :, :5]).reshape(2, -1)  # [L, 2 blocks x 3 pairs x 32]
    assert torch.equal(flat[:, 0, : dense.shape[1]], dense)
    assert not flat[:, 0, dense.shape[1] :].any() and not flat[:, 1].any()
    assert torch.equal(pairs[:, 2], rank_pairs(b[:, 2]))  # a slot of the stack's rank: as rank_pairs


def _with_pairs(group: LoRAGroup, factor: float = 1.0) -> LoRAGroup:
    projections = (replace(p, b_pairs=slot_pairs(p.b * factor, p.ranks.tolist())) for p in group.projections)
    return LoRAGroup(tuple(projections), group.meta)


def _pairs_factor(p: LoRAProjection) -> torch.Tensor:
    """2 for each slot whose B the native bf16 kernel reads in rank pairs, else 1, shaped to scale `p.b`
    `[L, S, ...]` (the tests' rows and widths fit both paths): on AVX512-BF16 every slot; with AMX only the
    ranks its tiles take (at most 16, or whole 32s: `sgmv_amx.h` `fits`), the others run on the AVX blocks
    from B itself."""
    tiled = [not amx_ready() or r <= 16 or r % 32 == 0 for r in p.ranks.tolist()]
    factor = torch.tensor([2.0 if t else 1.0 for t in tiled], dtype=p.b.dtype)
    return factor.view(1, -1, *([1] * (p.b.dim() - 2)))


PAIRS_SKIP = "this CPU has neither AMX nor AVX512-BF16 (the bf16 paths that read rank pairs)"


def _check_pairs_path(slots: list[int], x: torch.Tensor, y0: torch.Tensor, group: LoRAGroup) -> None:
    """The group with B in rank pairs against the reference, what it must not touch left bit-exact; and
    the pairs are what the expand reads: pairs of 2 * B give the reference of 2 * B."""
    y = y0.clone()
    sgmv_group(y, x, _with_pairs(group), layer=LAYER)
    assert rel_err(y, reference(slots, x, y0, group)) < TOLERANCE[torch.bfloat16]
    keep = untouched(slots, y0, group)
    assert torch.equal(y[keep], y0[keep])
    # 2 * B where the kernel reads the pairs; B itself where it reads B (AMX: ranks it does not tile)
    doubled = LoRAGroup(tuple(replace(p, b=p.b * _pairs_factor(p)) for p in group.projections), group.meta)
    y = y0.clone()
    sgmv_group(y, x, _with_pairs(group, 2.0), layer=LAYER)
    assert rel_err(y, reference(slots, x, y0, doubled)) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not bf16_pairs_ready(), reason=PAIRS_SKIP)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("hidden", [96, 64])
def test_native_bf16_group_reads_b_in_rank_pairs(
    popularity: str, hidden: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    for seed in range(3):
        # Rows of a multiple of 32 values (96, 64); the ranks (<= 16) and widths (16, 48 or 32) fit.
        slots, x, y0, group = group_case(popularity, torch.bfloat16, seed, transposed_b=True, hidden=hidden)
        _check_pairs_path(slots, x, y0, group)


@pytest.mark.skipif(not bf16_pairs_ready(), reason=PAIRS_SKIP)
def test_native_bf16_group_reads_rank_pairs_of_odd_and_wide_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Odd ranks (a last pair half zero), ranks past 16 that are no multiple of 32 (AMX's tiles take those
    on the AVX blocks; AVX512-BF16 in pairs) and 64 outputs (a whole pass of the expand) and 80 (a pass
    and one block)."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    odd_and_wide = ((64, [3, 24, 0, 5, 1]), (16, [7, 0, 0, 24, 2]), (80, [1, 3, 2, 0, 24]))
    for seed in range(3):
        slots, x, y0, group = group_case(
            "zipf", torch.bfloat16, seed, transposed_b=True, hidden=64, projections=odd_and_wide
        )
        _check_pairs_path(slots, x, y0, group)


@pytest.mark.skipif(not bf16_pairs_ready(), reason=PAIRS_SKIP)
def test_native_bf16_group_on_rank_pairs_gives_a_token_the_same_result_in_any_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each token's sums run in one order whatever the chunk around it: a segment's tokens one at a time
    give its batched result bit for bit."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    slots, x, y0, group = group_case("zipf", torch.bfloat16, 7, transposed_b=True, hidden=96)
    group = _with_pairs(group)
    batched = y0.clone()
    sgmv_group(batched, x, group, layer=LAYER)
    for t, slot in enumerate(slots):
        one = LoRABatchMeta.from_token_slots([slot])
        single = LoRAGroup(tuple(replace(p, meta=one) for p in group.projections), one)
        y = y0[t : t + 1].clone()
        sgmv_group(y, x[t : t + 1], single, layer=LAYER)
        assert torch.equal(y, batched[t : t + 1])


def test_native_group_refuses_pairs_of_the_wrong_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    _, x, y0, group = group_case("uniform", torch.bfloat16, 2, transposed_b=True, hidden=96)
    first, *rest = _with_pairs(group).projections
    assert first.b_pairs is not None
    bad = replace(first, b_pairs=first.b_pairs[:, :, :-1].contiguous())
    with pytest.raises(RuntimeError, match="rank pairs"):
        sgmv_group(y0.clone(), x, LoRAGroup((bad, *rest), group.meta), layer=LAYER)
