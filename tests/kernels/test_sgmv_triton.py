"""The Triton SGMV kernels against the float64 reference: on the GPU, or interpreted on CPU tensors.

Interpreted launches run in Python, hence the tiny shapes. bf16 there covers the kernels' fp32-upcast
`tl.dot` path (the interpreter's bf16 dot is broken); a GPU multiplies bf16 natively.
"""

from __future__ import annotations

import pytest
import torch

from kernels import LoRABatchMeta
from tests.kernels.kernel_testing import (
    POPULARITIES,
    RANK_SETS,
    check_expand,
    check_shrink,
    lora_case,
    run_sgmv_expand,
    run_sgmv_shrink,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "arrival-order"])
@pytest.mark.parametrize("base_share", [0.0, 0.3])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_shrink_and_expand_match_reference(
    popularity: str, base_share: float, grouped: bool, dtype: torch.dtype, device: str
) -> None:
    seed = len(popularity) + int(10 * base_share) + grouped
    case = lora_case(popularity, base_share, dtype, seed, grouped=grouped)
    check_shrink(case, run_sgmv_shrink(case, device))
    check_expand(case, run_sgmv_expand(case, device))


@pytest.mark.parametrize("rank_table", [True, False])
@pytest.mark.parametrize("rank_set", sorted(RANK_SETS))
def test_ranks_padded_or_from_the_rank_table(rank_set: str, rank_table: bool, device: str) -> None:
    case = lora_case("uniform", 0.2, torch.float32, 5, rank_set=rank_set, rank_table=rank_table)
    check_shrink(case, run_sgmv_shrink(case, device))
    check_expand(case, run_sgmv_expand(case, device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("block_m", "block_k", "split_k"), [(16, 16, 1), (16, 16, 3), (32, 32, 2)])
def test_shrink_tiles_and_split_k(
    block_m: int, block_k: int, split_k: int, dtype: torch.dtype, device: str
) -> None:
    from kernels.sgmv_triton import sgmv_shrink_triton

    # Segments up to 40 rows span several row tiles; hidden 80 spans several K tiles.
    case = lora_case("zipf", 0.2, dtype, 9, grouped=False, num_seqs=6, max_len=40, hidden=80)
    c = case.on(device)
    meta = LoRABatchMeta.from_token_slots(case.slots, device)
    y = c.y0.clone()
    tiles = {"block_m": block_m, "block_k": block_k, "split_k": split_k}
    sgmv_shrink_triton(y, c.x, c.stack.a, meta, layer=c.layer, scale=c.stack.scale, ranks=c.ranks, **tiles)
    check_shrink(case, y.cpu())


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 64)])
def test_expand_tiles(block_m: int, block_n: int, device: str) -> None:
    from kernels.sgmv_triton import sgmv_expand_triton

    case = lora_case("skewed", 0.2, torch.float32, 4, num_seqs=6, max_len=40, out=72)
    c = case.on(device)
    meta = LoRABatchMeta.from_token_slots(case.slots, device)
    y = c.out0.clone()
    tiles = {"block_m": block_m, "block_n": block_n}
    sgmv_expand_triton(y, c.v, c.stack.b, meta, layer=c.layer, y_offset=c.offset, ranks=c.ranks, **tiles)
    check_expand(case, y.cpu())


def test_tiles_below_the_gpu_dot_minimum_are_rejected(device: str) -> None:
    from kernels.sgmv_triton import sgmv_expand_triton, sgmv_shrink_triton

    c = lora_case("uniform", 0.0, torch.float32, 1).on(device)
    meta = LoRABatchMeta.from_token_slots(c.slots, device)
    with pytest.raises(ValueError, match="BLOCK_M"):
        sgmv_shrink_triton(c.y0.clone(), c.x, c.stack.a, meta, layer=c.layer, scale=c.stack.scale, block_m=8)
    with pytest.raises(ValueError, match="BLOCK_N"):
        sgmv_expand_triton(c.out0.clone(), c.v, c.stack.b, meta, layer=c.layer, block_n=8)
