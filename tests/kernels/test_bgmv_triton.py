"""The Triton BGMV kernels against the float64 per-token reference (GPU, or interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import (
    POPULARITIES,
    check_expand,
    check_shrink,
    lora_case,
    run_bgmv_expand,
    run_bgmv_shrink,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("base_share", [0.0, 0.3])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_decode_tokens_in_arrival_order_match_reference(
    popularity: str, base_share: float, dtype: torch.dtype, device: str
) -> None:
    case = lora_case(popularity, base_share, dtype, seed=3, grouped=False, num_seqs=12, max_len=1)
    check_shrink(case, run_bgmv_shrink(case, device))
    check_expand(case, run_bgmv_expand(case, device))


@pytest.mark.parametrize("rank_table", [True, False])
def test_padded_ranks_or_rank_table(rank_table: bool, device: str) -> None:
    case = lora_case("zipf", 0.2, torch.float32, 6, rank_table=rank_table, num_seqs=10, max_len=1)
    check_shrink(case, run_bgmv_shrink(case, device))
    check_expand(case, run_bgmv_expand(case, device))


@pytest.mark.parametrize("split_k", [1, 3])
def test_shrink_split_k_partials_add_up(split_k: int, device: str) -> None:
    from kernels.bgmv_triton import bgmv_shrink_triton

    case = lora_case("uniform", 0.2, torch.bfloat16, 8, grouped=False, num_seqs=8, max_len=1, hidden=200)
    c = case.on(device)
    y = c.y0.clone()
    bgmv_shrink_triton(y, c.x, c.stack.a, c.token_slots, c.layer, c.stack.scale, c.ranks, split_k=split_k)
    check_shrink(case, y.cpu())
