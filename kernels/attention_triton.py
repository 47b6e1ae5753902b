# mypy: allow-untyped-defs
# (@triton.jit kernels take untyped pointers and scalars; their wrappers below are typed.)
"""Triton paged attention (the GPU backend of `kernels.attention`): online-softmax over the block table.

Both kernels walk a sequence's context in tiles of `BLOCK_N` token positions; each position's cache row
is found through the block table (`block_tables[b, pos // BS]`, offset `pos % BS`), so any block size
works, smaller or larger than the tile. Softmax runs in the log2 domain (`exp2`), fp32 throughout.

Decode packs the `G` query heads that share a KV head into the rows of one `tl.dot` (padded to 16), so
K/V are read once per KV head. When batch × KV heads cannot fill the GPU, the context is split across
programs (flash-decoding) and a second kernel merges the partial results by their log-sum-exp.

Prefill runs one program per (query tile, sequence, query head). Queries sit at the end of their
context (a chunk after its cached prefix), so the causal bound is `pos <= c_b - n_b + j`; tiles past the
diagonal are never visited. The grid is sized by the total token count (no host sync for the longest
sequence); tiles past a sequence's queries return at once.

A sliding window `W` moves where the walk starts: decode splits only the last `W` positions, prefill
starts at the tile's first query minus `W - 1` and masks `pos <= q_pos - W` per row. A row may then see
no key in its first tiles, so the running max is read through `m_safe` (0 while still -inf). Without a
window the kernels get `NO_WINDOW`, larger than any context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_meta import AttentionMeta
from kernels.triton_util import (
    HOPPER_SMS,
    dot_flags,
    mma,
    pow2_tile,
    require_dot_tiles,
    require_unit_last_stride,
)

LOG2E = 1.4426950408889634
NO_WINDOW = 2**31 - 1


@triton.jit
def _decode_kernel(
    out_ptr,
    lse_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    ctx_ptr,
    qk_scale,
    window,
    G,
    D,
    BS,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    first = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - first, BLOCK_N), num_splits) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(ctx, lo + per_split)
    gs = tl.arange(0, BLOCK_G)
    ds = tl.arange(0, BLOCK_D)
    g_ok = gs < G
    d_ok = ds < D
    heads = kvh * G + gs
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + ds[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        blk = tl.load(bt_ptr + b * stride_btb + pos // BS, mask=ok, other=0)
        row = pos % BS
        k = tl.load(
            k_ptr + blk[None, :] * stride_kb + row[None, :] * stride_kt + kvh * stride_kh + ds[:, None],
            mask=ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = mma(q, k, tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32), UPCAST, PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(
            v_ptr + blk[:, None] * stride_vb + row[:, None] * stride_vt + kvh * stride_vh + ds[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        m_i = m_new
    mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # An empty split (context shorter than its range) leaves l_i = 0: weight 0 in the merge.
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        base = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
        tl.store(base + ds[None, :], o, mask=mask)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)
    else:
        o = acc / l_i[:, None]
        out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + ds[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    part_ptr,
    lse_ptr,
    D,
    num_splits,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    ds = tl.arange(0, BLOCK_D)
    s_ok = ss < num_splits
    d_ok = ds < D
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + ss, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + ss[:, None] * stride_ps + ds[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    o = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + ds, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _prefill_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    qsl_ptr,
    ctx_ptr,
    qk_scale,
    window,
    G,
    D,
    BS,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m_tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_first = tl.load(qsl_ptr + b).to(tl.int32)
    n = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_first
    if m_tile * BLOCK_M >= n:
        return
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    prefix = ctx - n
    kvh = h // G
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, BLOCK_D)
    row_ok = rows < n
    d_ok = ds < D
    q_pos = prefix + rows
    q = tl.load(
        q_ptr + (q_first + rows)[:, None] * stride_qt + h * stride_qh + ds[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.minimum(ctx, prefix + (m_tile + 1) * BLOCK_M)
    lo = tl.maximum(prefix + m_tile * BLOCK_M - window + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        blk = tl.load(bt_ptr + b * stride_btb + pos // BS, mask=ok, other=0)
        row = pos % BS
        k = tl.load(
            k_ptr + blk[None, :] * stride_kb + row[None, :] * stride_kt + kvh * stride_kh + ds[:, None],
            mask=ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = mma(q, k, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST, PRECISION) * qk_scale
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok[None, :] & seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(
            v_ptr + blk[:, None] * stride_vb + row[:, None] * stride_vt + kvh * stride_vh + ds[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        m_i = m_new
    # Only padding rows (past the sequence's queries) can have seen nothing within a window.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + (q_first + rows)[:, None] * stride_ot + h * stride_oh + ds[None, :]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _decode_splits(programs: int, max_tiles: int) -> int:
    want = max(1, 2 * HOPPER_SMS // max(programs, 1))
    return max(1, min(want, max_tiles, 32))


def paged_attention_decode_triton(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> None:
    """`kernels.attention.paged_attention_decode` on the GPU; keyword-only knobs override heuristics."""
    block_tables, context_lens = meta.block_tables, meta.context_lens
    batch, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if batch == 0:
        return
    require_unit_last_stride(out=out, q=q, k_cache=k_cache, v_cache=v_cache)
    group = num_heads // kv_heads
    bg = pow2_tile(group)
    bd = pow2_tile(head_dim, hi=256)
    # The table's width bounds every context without reading context_lens on the host.
    max_ctx = block_tables.shape[1] * block_size
    bn = block_n or pow2_tile(max_ctx, hi=64)
    require_dot_tiles(BLOCK_G=bg, BLOCK_N=bn, BLOCK_D=bd)
    window = sliding_window or NO_WINDOW
    splits = num_splits or _decode_splits(batch * kv_heads, triton.cdiv(min(max_ctx, window), bn))
    upcast, precision = dot_flags(q.dtype)
    if splits == 1:
        target, lse = out, out
        out_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        target = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
        out_strides = (target.stride(0), target.stride(1), target.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    _decode_kernel[(batch, kv_heads, splits)](
        target,
        lse,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale * LOG2E,
        window,
        group,
        head_dim,
        block_size,
        splits,
        q.stride(0),
        q.stride(1),
        *out_strides,
        *lse_strides,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        SPLIT=splits > 1,
        BLOCK_G=bg,
        BLOCK_N=bn,
        BLOCK_D=bd,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            out,
            target,
            lse,
            head_dim,
            splits,
            out.stride(0),
            out.stride(1),
            target.stride(0),
            target.stride(1),
            target.stride(2),
            lse.stride(0),
            lse.stride(1),
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=bd,
            num_warps=4,
        )


def paged_attention_prefill_triton(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    """`kernels.attention.paged_attention_prefill` on the GPU; keyword-only tiles override heuristics."""
    if meta.query_start_loc is None:
        raise ValueError("prefill attention needs meta.query_start_loc")
    block_tables, query_start_loc, context_lens = meta.block_tables, meta.query_start_loc, meta.context_lens
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    require_unit_last_stride(out=out, q=q, k_cache=k_cache, v_cache=v_cache)
    bd = pow2_tile(head_dim, hi=256)
    bm = block_m or pow2_tile(num_tokens, hi=64 if bd <= 128 else 32)
    bn = block_n or (64 if q.dtype != torch.float32 and bd <= 128 else 32)
    require_dot_tiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    upcast, precision = dot_flags(q.dtype)
    _prefill_kernel[(triton.cdiv(num_tokens, bm), batch, num_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale * LOG2E,
        sliding_window or NO_WINDOW,
        num_heads // kv_heads,
        head_dim,
        block_size,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=2,
    )
