"""A LoRA group's adapters inside the AMX linear layer (`kernels.linear_amx.linear_amx_lora`,
`kernels/csrc/linear_amx_lora.h`) against the two calls it replaces, `linear_amx` then `sgmv_group` (then
`silu_mul`), bit for bit: plain and gated weights, a module boundary inside a panel, columns no module
adapts, bias or none, decode-sized and prefill-sized row counts, short and long runs of one slot, and every
rank AMX's tiles take (1 to 16, 32, 64, and 0: a slot that leaves a module alone). The stacks hold NaN past
each slot's rank, so reading there fails the test."""

from __future__ import annotations

import pytest
import torch

from kernels import LoRABatchMeta, LoRAGroup, LoRAProjection, sgmv_group
from kernels.backend import BACKEND_ENV
from kernels.glue import silu_mul
from kernels.linear_amx import linear_amx, linear_amx_lora, lora_in_tiles, pack_amx
from kernels.sgmv_native import amx_ready, slot_pairs
from tests.kernels.kernel_testing import lora_stack, token_slots

pytestmark = pytest.mark.skipif(not amx_ready(), reason="this CPU (or process) cannot run AMX tiles")

K = 96
LAYER = 1
# Per layout: whether the weight is packed gated, the modules' output widths (side by side from column 0)
# and the output columns no module adapts after them. Per slot ranks, one list per module.
LAYOUTS = {
    "qkv": (False, (64, 32, 32), 32),
    "boundary-in-a-panel": (False, (48, 16, 16), 16),
    "gate-up": (True, (64, 64), 0),
}
RANKS = {
    3: ([8, 16, 0, 4, 64, 1], [8, 0, 1, 4, 16, 32], [0, 16, 2, 3, 64, 5]),
    2: ([8, 16, 0, 4, 32, 1], [8, 0, 1, 4, 16, 64]),
}


def _case(
    layout: str, rows: int, popularity: str, bias: bool, seed: int
) -> tuple[torch.Tensor, object, torch.Tensor | None, LoRAGroup]:
    gated, widths, tail = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    # sequences of 1 token (decode rows: short runs) or of up to 40 (prompts: long runs), 25% unadapted
    longest = 1 if popularity == "decode" else 40
    lens: list[int] = []
    while sum(lens) < rows:
        lens.append(min(rows - sum(lens), int(torch.randint(1, longest + 1, (1,), generator=gen))))
    ranks = RANKS[len(widths)]
    slots = token_slots(
        "zipf" if popularity == "decode" else popularity, lens, len(ranks[0]), gen, base_share=0.25
    )
    meta = LoRABatchMeta.from_token_slots(slots)
    projections, offset = [], 0
    for width, module_ranks in zip(widths, ranks, strict=True):
        stack = lora_stack(2, module_ranks, K, width, torch.bfloat16, gen, max_rank=64, padding=float("nan"))
        rank_t = torch.tensor(module_ranks, dtype=torch.int64)
        projections.append(
            LoRAProjection(
                stack.a,
                stack.b,
                stack.scale,
                rank_t,
                offset,
                meta.for_module(module_ranks, stack.scale.tolist()),
                slot_pairs(stack.b, module_ranks),
            )
        )
        offset += width
    n = offset + tail
    weight = pack_amx((torch.randn(n, K, generator=gen) / K**0.5).bfloat16(), gated=gated)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, K, generator=gen).bfloat16()
    return x, weight, b, LoRAGroup(tuple(projections), meta)


@pytest.mark.parametrize("layout", [*LAYOUTS, "gate-up-silu"])
@pytest.mark.parametrize("rows", [1, 13, 64, 200])
@pytest.mark.parametrize("popularity", ["decode", "zipf", "distinct"])
def test_adapters_inside_the_matmul_give_the_bits_of_linear_then_group(
    layout: str, rows: int, popularity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    silu = layout == "gate-up-silu"
    for seed in range(2):
        x, weight, bias, group = _case("gate-up" if silu else layout, rows, popularity, seed % 2 == 0, seed)
        assert lora_in_tiles(group)
        expected = linear_amx(x, weight, bias)
        sgmv_group(expected, x, group, layer=LAYER)
        if silu:
            expected = silu_mul(expected)
        got = linear_amx_lora(x, weight, bias, group, layer=LAYER, silu=silu)
        assert not got.isnan().any()
        assert torch.equal(got, expected)


def test_long_runs_tell_prompts_from_decode_rows() -> None:
    """The decoder adds a group inside the matmul only where its rows come in long runs of one slot."""
    _, _, _, prompts = _case("qkv", 200, "zipf", False, 3)
    _, _, _, decode = _case("qkv", 64, "decode", False, 3)
    assert torch.ops.loragate_cpu.sgmv_group_long_runs(prompts.native_plan)
    assert not torch.ops.loragate_cpu.sgmv_group_long_runs(decode.native_plan)


def test_ranks_the_tiles_do_not_take_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    x, weight, bias, group = _case("qkv", 13, "zipf", True, 4)
    first = group.projections[0]
    ranks = first.ranks.clone()
    ranks[0] = 24  # neither at most 16 nor a multiple of 32: the group kernel runs it on the AVX blocks
    odd = LoRAGroup(
        (
            LoRAProjection(first.a, first.b, first.scale, ranks, 0, first.meta, first.b_pairs),
            *group.projections[1:],
        ),
        group.meta,
    )
    assert not lora_in_tiles(odd)
    with pytest.raises(RuntimeError, match="do not run on AMX tiles"):
        linear_amx_lora(x, weight, bias, odd, layer=LAYER)
    with pytest.raises(ValueError, match="packed gated"):
        linear_amx_lora(x, weight, bias, group, layer=LAYER, silu=True)
    v = torch.ops.loragate_cpu.sgmv_group_v(group.native_plan, x.shape[0])
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="v must be"):
        torch.ops.loragate_cpu.linear_amx_lora(
            out, x, weight.panels, bias, 0, v[:, :1], group.native_plan, LAYER
        )
