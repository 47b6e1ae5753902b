"""The CPU BGMV path: per-token slots in any order, against the float64 per-token reference."""

from __future__ import annotations

import pytest
import torch

from kernels.bgmv_torch import group_tokens
from tests.kernels.kernel_testing import (
    POPULARITIES,
    check_expand,
    check_shrink,
    lora_case,
    run_bgmv_expand,
    run_bgmv_shrink,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "arrival-order"])
@pytest.mark.parametrize("base_share", [0.0, 0.3])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_decode_tokens_match_reference(
    popularity: str, base_share: float, grouped: bool, dtype: torch.dtype
) -> None:
    case = lora_case(popularity, base_share, dtype, 21, grouped=grouped, num_seqs=24, max_len=1, hidden=64)
    check_shrink(case, run_bgmv_shrink(case))
    check_expand(case, run_bgmv_expand(case))


@pytest.mark.parametrize(
    ("slots", "order", "segments"),
    [
        ([2, 2, -1, 0], None, [(0, 2, 2), (3, 4, 0)]),
        ([1, 0, 1, -1, 0], [1, 4, 0, 2], [(0, 2, 0), (2, 4, 1)]),
        ([-1, -1], None, []),
        ([], None, []),
    ],
    ids=["grouped", "interleaved", "all-base", "empty"],
)
def test_group_tokens_sorts_only_when_slots_interleave(
    slots: list[int], order: list[int] | None, segments: list[tuple[int, int, int]]
) -> None:
    got_order, got_segments = group_tokens(torch.tensor(slots, dtype=torch.int64))
    assert (got_order.tolist() if got_order is not None else None) == order
    assert got_segments == segments
