"""LoRABatchMeta: per-token slots become segments once per step."""

from __future__ import annotations

import torch

from kernels import LoRABatchMeta


def test_worked_example_from_the_docstring() -> None:
    meta = LoRABatchMeta.from_token_slots([2, 2, 2, -1, -1, 0, 0, 0, 0])
    assert meta.seg_indptr.tolist() == [0, 3, 5, 9]
    assert meta.slot_ids.tolist() == [2, -1, 0]
    assert meta.segments == ((0, 3, 2), (5, 9, 0))
    assert meta.active_slots == frozenset({0, 2})
    assert meta.seg_indptr.dtype == meta.slot_ids.dtype == torch.int64


def test_repeated_slot_runs_stay_separate_segments() -> None:
    meta = LoRABatchMeta.from_token_slots([1, 0, 1])
    assert meta.segments == ((0, 1, 1), (1, 2, 0), (2, 3, 1))
