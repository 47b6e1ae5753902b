"""Per-step LoRA segment metadata, built once from per-token adapter slots and shared by every layer.

Worked example: token slots `[2, 2, 2, -1, -1, 0, 0, 0, 0]` (the engine orders a batch's sequences by
slot, so tokens of one adapter are contiguous) give three segments:
`seg_indptr = [0, 3, 5, 9]`, `slot_ids = [2, -1, 0]`, and on the host `segments = ((0, 3, 2), (5, 9, 0))`
(slot -1 dropped). Slot -1 means "no adapter"; kernels skip it. The Triton kernels read the two device
tensors; the torch path loops over `segments`, so no layer reads segment bounds back from the device.
Likewise the slot tables: `for_module` gives the step's meta for one target module with host copies of
that module's per-slot ranks and scales, made once per step, which the torch path reads instead of the
`ranks` / `scale` tensors in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

Segment = tuple[int, int, int]  # (first token, end token, adapter slot >= 0)
TABLE_COLUMNS = 11  # the columns of `LoRAGroup.projection_table`


@dataclass(frozen=True)
class LoRABatchMeta:
    """Segments of a step's tokens: `seg_indptr[i]:seg_indptr[i+1]` all use adapter slot `slot_ids[i]`.

    seg_indptr: [num_segments + 1] int64, on the compute device.
    slot_ids: [num_segments] int64, on the compute device.
    segments: the same segments as Python `(start, end, slot)` tuples, non-empty and slot >= 0 only
        (the torch path's loop, and the step's active slots).
    host_ranks, host_scale: [S] on the host, optional: the per-slot ranks and scales of the module this
        meta is used with, equal to the `ranks` / `scale` tensors passed beside it (see `for_module`).
    """

    seg_indptr: torch.Tensor
    slot_ids: torch.Tensor
    segments: tuple[Segment, ...]
    host_ranks: tuple[int, ...] | None = None
    host_scale: tuple[float, ...] | None = None

    def for_module(self, ranks: Sequence[int], scale: Sequence[float]) -> LoRABatchMeta:
        """This step's segments with one module's slot tables on the host (copied once per step)."""
        return replace(self, host_ranks=tuple(ranks), host_scale=tuple(scale))

    @cached_property
    def segment_table(self) -> torch.Tensor:
        """`segments` as an int64 `[N, 3]` host tensor (the native CPU kernels' input), made once."""
        return torch.tensor(self.segments, dtype=torch.int64).view(-1, 3)

    @property
    def active_slots(self) -> frozenset[int]:
        return frozenset(slot for _, _, slot in self.segments)

    @staticmethod
    def runs(token_slots: list[int]) -> tuple[list[int], list[int], tuple[Segment, ...]]:
        """`(seg_indptr, slot_ids, segments)` on the host: maximal runs of equal consecutive slots become
        segments. For callers that move the two lists to the device themselves."""
        starts = [i for i, s in enumerate(token_slots) if i == 0 or s != token_slots[i - 1]]
        bounds = [*starts, len(token_slots)]
        slots = [token_slots[i] for i in starts]
        segments = tuple((bounds[i], bounds[i + 1], slot) for i, slot in enumerate(slots) if slot >= 0)
        return bounds, slots, segments

    @staticmethod
    def from_token_slots(token_slots: list[int], device: torch.device | str = "cpu") -> LoRABatchMeta:
        """Maximal runs of equal consecutive slots become segments."""
        bounds, slots, segments = LoRABatchMeta.runs(token_slots)
        return LoRABatchMeta(
            seg_indptr=torch.tensor(bounds, dtype=torch.int64, device=device),
            slot_ids=torch.tensor(slots, dtype=torch.int64, device=device),
            segments=segments,
        )


@dataclass(frozen=True)
class LoRAProjection:
    """One adapted projection of a `LoRAGroup`: its stacked weights, slot tables and output slice.

    a: [L, S, R, in] stacked A weights; b: [L, S, out, R] stacked B weights (any strides);
    scale: [S] float32 and ranks: [S] int64 per-slot tables (rank 0: the slot does not adapt it);
    y_offset: the first column of the fused output it adds into;
    meta: the step's segments with this projection's slot tables on the host (`for_module`);
    b_pairs: optional, the same B in rank pairs `[L, S, out / 16, ceil(R / 2), 32]`, each slot's own ranks
        packed densely (`kernels.sgmv_native.slot_pairs`), which the native CPU kernel's bf16 paths
        read (AMX, AVX512-BF16).
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    ranks: torch.Tensor
    y_offset: int
    meta: LoRABatchMeta
    b_pairs: torch.Tensor | None = None


@dataclass(frozen=True)
class LoRAGroup:
    """The adapted projections that read one input and add into column slices of one fused output (q/k/v,
    gate/up), for one step: built once per step, used by every layer (`kernels.sgmv.sgmv_group`)."""

    projections: tuple[LoRAProjection, ...]
    meta: LoRABatchMeta

    @cached_property
    def rank_table(self) -> torch.Tensor:
        """`[M, S]` int64: each projection's ranks (the native kernel's input), made once."""
        return torch.stack([p.ranks.to(torch.int64) for p in self.projections]).contiguous()

    @cached_property
    def scale_table(self) -> torch.Tensor:
        """`[M, S]` float32: each projection's scales, made once."""
        return torch.stack([p.scale.to(torch.float32) for p in self.projections]).contiguous()

    @cached_property
    def projection_table(self) -> torch.Tensor:
        """`[M, TABLE_COLUMNS]` int64 on the weights' device (the Triton kernel's input), made once: per
        projection the address of `a` and its strides over layers, slots and rank rows; the same for `b`
        (rows: output features); its output width; its first output column; its first column in the
        shared intermediate (the running sum of the stacks' ranks)."""
        rows, v_col = [], 0
        for p in self.projections:
            a, b = p.a, p.b
            a_cols = [a.data_ptr(), *a.stride()[:3]]
            b_cols = [b.data_ptr(), *b.stride()[:3]]
            rows.append([*a_cols, *b_cols, b.shape[2], p.y_offset, v_col])
            v_col += a.shape[2]
        return torch.tensor(rows, dtype=torch.int64, device=self.projections[0].a.device)

    @cached_property
    def native_plan(self) -> torch.Tensor:
        """The native CPU kernel's plan of this step (`kernels.sgmv_native.group_plan`): the projections'
        stacks, slot tables, output offsets and the segments' chunks, checked and laid out once per step
        and run by each layer's call."""
        from kernels.sgmv_native import group_plan

        return group_plan(self)
