"""CPU (torch) path of the SGMV kernels: one matmul per segment.

Segments come from `LoRABatchMeta.segments`, Python tuples computed once per step, so no projection of
any layer reads segment bounds back from a tensor. A step has at most `max_loras` adapters, so the loop
runs a handful of times per projection, never per token. With a rank table, each slot's padded weights
are sliced to its true rank, so a rank-8 adapter stacked in a rank-64 buffer costs rank-8 work.
Gathering each token's weights for one batched matmul (gather-bmm) is the alternative;
`loadtest.bench_kernels` measures it 9-100× slower here, as it copies `T × R × H` weights per call.

16-bit inputs: fp16 matmuls are slow on CPUs, so fp16 segments run in fp32. A bf16 matmul costs ~25 µs
of fixed overhead here (oneDNN), so short bf16 segments (decode) run in fp32 too; long ones stay in bf16.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora_meta import LoRABatchMeta, Segment

# Up to this many rows, a bf16 segment is cheaper upcast to fp32 than on the bf16 (AMX/oneDNN) path.
BF16_FP32_MAX_ROWS = 8


def _addmm(out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, alpha: float = 1.0) -> None:
    """`out += alpha * a @ b_t`, in fp32 where the 16-bit matmul is the slower one."""
    if out.dtype == torch.float16 or (out.dtype == torch.bfloat16 and a.shape[0] <= BF16_FP32_MAX_ROWS):
        out.add_(torch.mm(a.float(), b_t.float()), alpha=alpha)
    else:
        out.addmm_(a, b_t, alpha=alpha)


def shrink_segments(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    segments: tuple[Segment, ...],
    scales: Sequence[float],
    rank_list: Sequence[int] | None,
) -> None:
    for start, end, slot in segments:
        r = rank_list[slot] if rank_list is not None else weights.shape[1]
        if r:
            _addmm(y[start:end, :r], x[start:end], weights[slot, :r].t(), alpha=scales[slot])


def expand_segments(
    y: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    segments: tuple[Segment, ...],
    rank_list: Sequence[int] | None,
) -> None:
    for start, end, slot in segments:
        r = rank_list[slot] if rank_list is not None else weights.shape[2]
        if r:
            _addmm(y[start:end], v[start:end, :r], weights[slot, :, :r].t())


def sgmv_shrink_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    shrink_segments(y, x, lora_a[layer], meta.segments, _scales(meta, scale), _ranks(meta, ranks))


def sgmv_expand_torch(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
) -> None:
    out = y.narrow(1, y_offset, lora_b.shape[2])
    expand_segments(out, v, lora_b[layer], meta.segments, _ranks(meta, ranks))


def _scales(meta: LoRABatchMeta, scale: torch.Tensor) -> Sequence[float]:
    """The per-slot scales on the host: the step's copy when it has one, else read back (tests, benches)."""
    return meta.host_scale if meta.host_scale is not None else scale.tolist()


def _ranks(meta: LoRABatchMeta, ranks: torch.Tensor | None) -> Sequence[int] | None:
    if ranks is None:
        return None
    return meta.host_ranks if meta.host_ranks is not None else ranks.tolist()
