# mypy: allow-untyped-defs
# (@triton.jit kernels take untyped pointers and scalars; their wrappers below are typed.)
"""Triton SGMV kernels (the GPU backend of `kernels.sgmv`): one program per (row tile, column tile, segment).

The grid is sized from shapes alone, so a launch never waits for the device: every segment gets
`cdiv(T, BLOCK_M)` row tiles and the tiles past a segment's end return at once (cheap next to a host
sync per projection and layer). Slot -1 segments and columns past a slot's true rank return or mask
likewise. The shrink reduces over the wide input dimension, so short batches (decode) split that
reduction across programs (split-K) to fill the GPU; the partial sums meet by atomic adds in an fp32
buffer. Tile sizes and `num_warps` are chosen for Hopper (sm_90).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_meta import LoRABatchMeta
from kernels.triton_util import (
    dot_flags,
    mma,
    pow2_tile,
    require_dot_tiles,
    require_unit_last_stride,
    sgmv_block_m,
    sgmv_split_k,
)


@triton.jit(do_not_specialize=["split_k"])
def _shrink_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    indptr_ptr,
    slot_ptr,
    scale_ptr,
    rank_ptr,
    H,
    R,
    stride_om,
    stride_xm,
    stride_ws,
    stride_wr,
    split_k,
    HAS_RANKS: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(2)
    slot = tl.load(slot_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    row0 = start + tl.program_id(0) * BLOCK_M
    col0 = (tl.program_id(1) // split_k) * BLOCK_N
    k_first = (tl.program_id(1) % split_k) * BLOCK_K
    rank = R
    if HAS_RANKS:
        rank = tl.load(rank_ptr + tl.maximum(slot, 0)).to(tl.int32)
    if (slot < 0) | (row0 >= end) | (col0 >= rank):
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < rank
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + slot * stride_ws + cols[None, :] * stride_wr + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, H, split_k * BLOCK_K):
        k_ok = (k0 + ks) < H
        xt = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mma(xt, wt, acc, UPCAST, PRECISION)
    acc *= tl.load(scale_ptr + slot).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        prev = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (prev + acc).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_kernel(
    y_ptr,
    v_ptr,
    w_ptr,
    indptr_ptr,
    slot_ptr,
    rank_ptr,
    N,
    R,
    stride_ym,
    stride_vm,
    stride_ws,
    stride_wn,
    HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(2)
    slot = tl.load(slot_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    row0 = start + tl.program_id(0) * BLOCK_M
    rank = R
    if HAS_RANKS:
        rank = tl.load(rank_ptr + tl.maximum(slot, 0)).to(tl.int32)
    if (slot < 0) | (row0 >= end) | (rank == 0):
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < N
    v_ptrs = v_ptr + rows[:, None] * stride_vm + ks[None, :]
    w_ptrs = w_ptr + slot * stride_ws + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k_ok = (k0 + ks) < rank
        vt = tl.load(v_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mma(vt, wt, acc, UPCAST, PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    prev = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (prev + acc).to(y_ptr.dtype.element_ty), mask=mask)


def sgmv_shrink_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
) -> None:
    """`kernels.sgmv.sgmv_shrink` on the GPU; the keyword-only tiles override the heuristics (tests)."""
    num_tokens, hidden = x.shape
    seg_indptr, slot_ids = meta.seg_indptr, meta.slot_ids
    weights = lora_a[layer]
    rank = weights.shape[1]
    num_segments = slot_ids.shape[0]
    if num_tokens == 0 or num_segments == 0:
        return
    require_unit_last_stride(y=y, x=x, lora_a=weights)
    bm = block_m or sgmv_block_m(num_tokens, num_segments)
    bn = pow2_tile(rank, hi=64)
    bk = block_k or pow2_tile(hidden, hi=64 if x.dtype == torch.float32 else 128)
    require_dot_tiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    m_tiles, n_tiles = triton.cdiv(num_tokens, bm), triton.cdiv(rank, bn)
    splits = split_k or sgmv_split_k((m_tiles + num_segments) * n_tiles, triton.cdiv(hidden, bk))
    # Split-K partials meet in fp32 (atomics on 16-bit floats would round every partial sum).
    out = y if splits == 1 else torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    upcast, precision = dot_flags(x.dtype)
    _shrink_kernel[(m_tiles, n_tiles * splits, num_segments)](
        out,
        x,
        weights,
        seg_indptr,
        slot_ids,
        scale,
        ranks if ranks is not None else slot_ids,
        hidden,
        rank,
        out.stride(0),
        x.stride(0),
        weights.stride(0),
        weights.stride(1),
        splits,  # a runtime argument: one compiled kernel serves every split
        HAS_RANKS=ranks is not None,
        ATOMIC=splits > 1,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=3,
    )
    if splits > 1:
        y.add_(out)


def sgmv_expand_triton(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    """`kernels.sgmv.sgmv_expand` on the GPU; the keyword-only tiles override the heuristics (tests)."""
    num_tokens = v.shape[0]
    seg_indptr, slot_ids = meta.seg_indptr, meta.slot_ids
    weights = lora_b[layer]
    out_features, rank = weights.shape[1], weights.shape[2]
    num_segments = slot_ids.shape[0]
    if num_tokens == 0 or num_segments == 0:
        return
    y_slice = y.narrow(1, y_offset, out_features)
    require_unit_last_stride(y=y_slice, v=v, lora_b=weights)
    bm = block_m or sgmv_block_m(num_tokens, num_segments)
    bn = block_n or pow2_tile(out_features, hi=128)
    bk = pow2_tile(rank, hi=64)
    require_dot_tiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    upcast, precision = dot_flags(v.dtype)
    grid = (triton.cdiv(num_tokens, bm), triton.cdiv(out_features, bn), num_segments)
    _expand_kernel[grid](
        y_slice,
        v,
        weights,
        seg_indptr,
        slot_ids,
        ranks if ranks is not None else slot_ids,
        out_features,
        rank,
        y_slice.stride(0),
        v.stride(0),
        weights.stride(0),
        weights.stride(1),
        HAS_RANKS=ranks is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=3,
    )
