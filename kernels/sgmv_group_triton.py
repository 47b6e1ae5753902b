# mypy: allow-untyped-defs
# (@triton.jit kernels take untyped pointers and scalars; their wrapper below is typed.)
"""Triton `sgmv_group`: every adapted projection of a fused output in two launches, shrink then expand.

A decode step on a GPU is launch-bound: the per-projection loop (`sgmv_shrink` + `sgmv_expand` per q, k, v,
o, gate, up, down) costs about three launches per projection per layer, more than the dense layers
themselves. Here the projections become one more grid axis. Their weights live in separate stacks, so
each program reads its projection's row of a small int64 table (`LoRAGroup.projection_table`: the stacks'
addresses and strides, output widths, output and intermediate column offsets) and casts the address to a
pointer, as punica's multi-slice kernels do.

The intermediate `v` of every projection shares one fp32 buffer `[T, ΣR]`; the expand rounds each tile to
the weights' dtype before its product, as the per-projection path rounds `v` to `x`'s dtype between the
two (the same roundings; the K splits, and so the fp32 summation order, may differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_meta import TABLE_COLUMNS, LoRAGroup
from kernels.triton_util import (
    dot_flags,
    mma,
    pow2_tile,
    require_dot_tiles,
    require_unit_last_stride,
    round_to,
    sgmv_block_m,
    sgmv_split_k,
)


# Runtime integers that take many values are not specialized on (Triton would compile a variant for 1
# and for multiples of 16 of each).
@triton.jit(do_not_specialize=["layer", "S", "M", "split_k", "stride_vm"])
def _group_shrink_kernel(
    v_ptr,
    x_ptr,
    table_ptr,
    indptr_ptr,
    slot_ptr,
    scale_ptr,
    rank_ptr,
    layer,
    H,
    S,
    M,
    split_k,
    stride_vm,
    stride_xm,
    COLS: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(2) // M
    proj = tl.program_id(2) % M
    slot = tl.load(slot_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    row0 = start + tl.program_id(0) * BLOCK_M
    col0 = (tl.program_id(1) // split_k) * BLOCK_N
    k_first = (tl.program_id(1) % split_k) * BLOCK_K
    if (slot < 0) | (row0 >= end):
        return
    rank = tl.load(rank_ptr + proj * S + slot).to(tl.int32)
    if col0 >= rank:
        return
    row = table_ptr + proj * COLS
    a_ptr = tl.load(row + 0).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_offset = layer * tl.load(row + 1) + slot * tl.load(row + 2)
    stride_ar = tl.load(row + 3)
    v_col = tl.load(row + 10)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < rank
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = a_ptr + a_offset + cols[None, :] * stride_ar + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, H, split_k * BLOCK_K):
        k_ok = (k0 + ks) < H
        xt = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mma(xt, wt, acc, UPCAST, PRECISION)
    acc *= tl.load(scale_ptr + proj * S + slot).to(tl.float32)
    v_ptrs = v_ptr + rows[:, None] * stride_vm + v_col + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(v_ptrs, acc, mask=mask)
    else:
        tl.store(v_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["layer", "S", "M", "stride_vm"])
def _group_expand_kernel(
    y_ptr,
    v_ptr,
    table_ptr,
    indptr_ptr,
    slot_ptr,
    rank_ptr,
    layer,
    S,
    M,
    stride_ym,
    stride_vm,
    COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(2) // M
    proj = tl.program_id(2) % M
    slot = tl.load(slot_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    row0 = start + tl.program_id(0) * BLOCK_M
    if (slot < 0) | (row0 >= end):
        return
    row = table_ptr + proj * COLS
    n_out = tl.load(row + 8)
    col0 = tl.program_id(1) * BLOCK_N
    rank = tl.load(rank_ptr + proj * S + slot).to(tl.int32)
    if (rank == 0) | (col0 >= n_out):
        return
    b_ptr = tl.load(row + 4).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_offset = layer * tl.load(row + 5) + slot * tl.load(row + 6)
    stride_bn = tl.load(row + 7)
    y_col = tl.load(row + 9)
    v_col = tl.load(row + 10)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < n_out
    v_ptrs = v_ptr + rows[:, None] * stride_vm + v_col + ks[None, :]
    w_ptrs = b_ptr + b_offset + cols[None, :] * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k_ok = (k0 + ks) < rank
        vt = tl.load(v_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mma(round_to(vt, y_ptr.dtype.element_ty, UPCAST), wt, acc, UPCAST, PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + y_col + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    prev = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (prev + acc).to(y_ptr.dtype.element_ty), mask=mask)


def sgmv_group_triton(y: torch.Tensor, x: torch.Tensor, group: LoRAGroup, *, layer: int) -> None:
    """`kernels.sgmv.sgmv_group` on the GPU: one shrink and one expand launch for all of `group`."""
    num_tokens, hidden = x.shape
    meta, projections = group.meta, group.projections
    num_segments, num_proj = meta.slot_ids.shape[0], len(projections)
    if num_tokens == 0 or num_segments == 0 or num_proj == 0:
        return
    for p in projections:
        require_unit_last_stride(lora_a=p.a, lora_b=p.b)
        if p.a.dtype != x.dtype or p.b.dtype != y.dtype:
            raise ValueError(f"sgmv_group: weights {p.a.dtype}/{p.b.dtype}, x {x.dtype}, y {y.dtype}")
    require_unit_last_stride(y=y, x=x)
    table = group.projection_table
    max_rank = max(p.a.shape[2] for p in projections)
    max_out = max(p.b.shape[2] for p in projections)
    slots = group.rank_table.shape[1]
    bm = sgmv_block_m(num_tokens, num_segments)
    upcast, precision = dot_flags(x.dtype)

    bn, bk = pow2_tile(max_rank, hi=64), pow2_tile(hidden, hi=64 if x.dtype == torch.float32 else 128)
    require_dot_tiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    m_tiles, n_tiles = triton.cdiv(num_tokens, bm), triton.cdiv(max_rank, bn)
    splits = sgmv_split_k((m_tiles + num_segments) * n_tiles * num_proj, triton.cdiv(hidden, bk))
    v_cols = sum(p.a.shape[2] for p in projections)
    alloc = torch.zeros if splits > 1 else torch.empty
    v = alloc(num_tokens, v_cols, dtype=torch.float32, device=x.device)
    _group_shrink_kernel[(m_tiles, n_tiles * splits, num_segments * num_proj)](
        v,
        x,
        table,
        meta.seg_indptr,
        meta.slot_ids,
        group.scale_table,
        group.rank_table,
        layer,
        hidden,
        slots,
        num_proj,
        splits,
        v.stride(0),
        x.stride(0),
        COLS=TABLE_COLUMNS,
        ATOMIC=splits > 1,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=3,
    )
    bn, bk = pow2_tile(max_out, hi=128), pow2_tile(max_rank, hi=64)
    require_dot_tiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    grid = (triton.cdiv(num_tokens, bm), triton.cdiv(max_out, bn), num_segments * num_proj)
    _group_expand_kernel[grid](
        y,
        v,
        table,
        meta.seg_indptr,
        meta.slot_ids,
        group.rank_table,
        layer,
        slots,
        num_proj,
        y.stride(0),
        v.stride(0),
        COLS=TABLE_COLUMNS,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=3,
    )
