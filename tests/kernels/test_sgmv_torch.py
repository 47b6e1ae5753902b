"""The CPU SGMV paths against the float64 per-token reference, over adapter popularity, ranks and dtypes.

Tests taking `cpu_backend` run on the torch loop and on the native C++ kernels (`kernels.native`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import LoRABatchMeta, sgmv_expand, sgmv_shrink
from tests.kernels.kernel_testing import (
    POPULARITIES,
    RANK_SETS,
    check_expand,
    check_shrink,
    lora_case,
    run_sgmv_expand,
    run_sgmv_shrink,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("base_share", [0.0, 0.3])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_shrink_and_expand_match_reference_for_each_popularity(
    popularity: str, base_share: float, dtype: torch.dtype, cpu_backend: str
) -> None:
    for seed in range(3):
        case = lora_case(popularity, base_share, dtype, seed, num_seqs=12, max_len=20, hidden=96, out=72)
        check_shrink(case, run_sgmv_shrink(case))
        check_expand(case, run_sgmv_expand(case))


@pytest.mark.parametrize("rank_table", [True, False])
@pytest.mark.parametrize("rank_set", sorted(RANK_SETS))
def test_ranks_padded_or_from_the_rank_table(rank_set: str, rank_table: bool, cpu_backend: str) -> None:
    case = lora_case("uniform", 0.2, torch.float32, 7, rank_set=rank_set, rank_table=rank_table)
    check_shrink(case, run_sgmv_shrink(case))
    check_expand(case, run_sgmv_expand(case))


@pytest.mark.parametrize("popularity", ["uniform", "zipf"])
def test_ungrouped_tokens_make_more_segments_with_repeated_slots(popularity: str, cpu_backend: str) -> None:
    case = lora_case(popularity, 0.3, torch.float32, 11, grouped=False, num_seqs=16)
    meta = LoRABatchMeta.from_token_slots(case.slots)
    assert len(meta.slot_ids) > len(set(case.slots))
    check_shrink(case, run_sgmv_shrink(case))
    check_expand(case, run_sgmv_expand(case))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_long_16bit_segments_take_the_16bit_matmul(dtype: torch.dtype, cpu_backend: str) -> None:
    case = lora_case("identical", 0.0, dtype, 3, num_seqs=4, max_len=64, hidden=256, out=128)
    check_shrink(case, run_sgmv_shrink(case))
    check_expand(case, run_sgmv_expand(case))


def test_all_tokens_without_adapter_leave_outputs_untouched(cpu_backend: str) -> None:
    case = lora_case("uniform", 1.0, torch.float32, 5)
    assert set(case.slots) == {-1}
    assert torch.equal(run_sgmv_shrink(case), case.y0)
    assert torch.equal(run_sgmv_expand(case), case.out0)


def test_segments_come_from_the_host_metadata_never_from_the_device_tensors() -> None:
    """The torch path reads the step's Python segments: its device tensors may be unreadable ("meta")."""
    case = lora_case("zipf", 0.3, torch.float32, 13)
    host = LoRABatchMeta.from_token_slots(case.slots)
    unreadable = LoRABatchMeta(host.seg_indptr.to("meta"), host.slot_ids.to("meta"), host.segments)
    y, out = case.y0.clone(), case.out0.clone()
    sgmv_shrink(
        y, case.x, case.stack.a, unreadable, layer=case.layer, scale=case.stack.scale, ranks=case.ranks
    )
    sgmv_expand(
        out, case.v, case.stack.b, unreadable, layer=case.layer, y_offset=case.offset, ranks=case.ranks
    )
    check_shrink(case, y)
    check_expand(case, out)


def test_slot_tables_from_the_step_mean_no_layer_reads_the_device_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the module's ranks and scales on the host (`LoRABatchMeta.for_module`, made once per step),
    shrink and expand call no `.tolist()` in any layer, and still match the reference."""
    case = lora_case("zipf", 0.3, torch.float32, 13)
    assert case.ranks is not None
    meta = LoRABatchMeta.from_token_slots(case.slots).for_module(
        case.ranks.tolist(), case.stack.scale.tolist()
    )

    def no_read_back(self: torch.Tensor) -> list[object]:
        raise AssertionError("a layer read a tensor back to the host")

    y, out = case.y0.clone(), case.out0.clone()
    monkeypatch.setattr(torch.Tensor, "tolist", no_read_back)
    sgmv_shrink(y, case.x, case.stack.a, meta, layer=case.layer, scale=case.stack.scale, ranks=case.ranks)
    sgmv_expand(out, case.v, case.stack.b, meta, layer=case.layer, y_offset=case.offset, ranks=case.ranks)
    monkeypatch.undo()
    check_shrink(case, y)
    check_expand(case, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_reads_b_stored_transposed(dtype: torch.dtype, cpu_backend: str) -> None:
    # The CPU engine keeps B as [L, S, R, N] seen through its transpose (`worker.adapter_cache`).
    case = lora_case("zipf", 0.2, dtype, 13, num_seqs=10, max_len=12, hidden=64, out=48)
    b = case.stack.b
    transposed = b.transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(transposed.nan_to_num(), b.nan_to_num()) and transposed.stride(-2) == 1
    y = run_sgmv_expand(replace(case, stack=replace(case.stack, b=transposed)))
    check_expand(case, y)
