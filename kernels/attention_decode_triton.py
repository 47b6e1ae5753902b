# mypy: allow-untyped-defs
# (@triton.jit kernels take untyped pointers and scalars; their wrappers below are typed.)
"""Triton paged decode attention (the GPU backend of `kernels.attention.paged_attention_decode`).

The kernel walks a sequence's context in tiles of `BLOCK_N` token positions with an online softmax in
the log2 domain (`exp2`), fp32 throughout; each position's cache row is found through the block table
(`block_tables[b, pos // BS]`, offset `pos % BS`), so any block size works, smaller or larger than the
tile. It packs the `G` query heads that share a KV head into the rows of one `tl.dot` (padded to 16),
so K/V are read once per KV head. When batch × KV heads cannot fill the GPU, the context is split across
programs (flash-decoding) and a second kernel merges the partial results by their log-sum-exp. A sliding
window `W` only moves where the walk starts: the splits cover the last `W` positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_meta import AttentionMeta
from kernels.triton_util import (
    HOPPER_SMS,
    LOG2E,
    NO_WINDOW,
    dot_flags,
    kv_cache_strides,
    mma,
    pow2_tile,
    require_dot_tiles,
    require_unit_last_stride,
)

MAX_SPLITS = 32  # context splits per (sequence, KV head) the heuristic picks at most


# Runtime integers that take many values are not specialized on (Triton would compile a variant for 1
# and for multiples of 16 of each): the block table's width, the number of splits.
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
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


@triton.jit(do_not_specialize=["num_splits"])
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
    batch, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if batch == 0:
        return
    require_unit_last_stride(out=out, q=q, k_cache=k_cache, v_cache=v_cache)
    # The table's width bounds every context without reading context_lens on the host.
    max_ctx = meta.block_tables.shape[1] * block_size
    group = num_heads // kv_heads
    bg, bn, bd = _decode_tiles(group, head_dim, max_ctx, block_n)
    window = sliding_window or NO_WINDOW
    splits = num_splits or _decode_splits(batch * kv_heads, triton.cdiv(min(max_ctx, window), bn))
    part, lse, part_strides, lse_strides = _decode_targets(out, q, splits)
    upcast, precision = dot_flags(q.dtype)
    _decode_kernel[(batch, kv_heads, splits)](
        part,
        lse,
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        scale * LOG2E,
        window,
        group,
        head_dim,
        block_size,
        splits,
        q.stride(0),
        q.stride(1),
        *part_strides,
        *lse_strides,
        *kv_cache_strides(k_cache, v_cache),
        meta.block_tables.stride(0),
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
        _merge_splits(out, part, lse, block_d=bd)


def _decode_tiles(group: int, head_dim: int, max_ctx: int, block_n: int | None) -> tuple[int, int, int]:
    """`(BLOCK_G, BLOCK_N, BLOCK_D)`: the query heads of a KV head, the context tile and the head dim."""
    bg = pow2_tile(group)
    bd = pow2_tile(head_dim, hi=256)
    bn = block_n or pow2_tile(max_ctx, hi=64)
    require_dot_tiles(BLOCK_G=bg, BLOCK_N=bn, BLOCK_D=bd)
    return bg, bn, bd


def _decode_splits(programs: int, max_tiles: int) -> int:
    """Context splits per (sequence, KV head): about two programs per SM, at most one per tile, <= 32."""
    want = max(1, 2 * HOPPER_SMS // max(programs, 1))
    return max(1, min(want, max_tiles, MAX_SPLITS))


def _decode_targets(
    out: torch.Tensor, q: torch.Tensor, splits: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], tuple[int, int]]:
    """Where the decode kernel writes, with the strides it is given: `(part, lse, part_strides, lse_strides)`.

    One split writes `out` directly (the lse is not stored; zero strides keep the arguments uniform).
    More write fp32 partial outputs `[B, H, S, D]` and their log2-sum-exps `[B, H, S]` for the merge; the
    log-sum-exps' rows are padded to a multiple of 16, so their strides specialise alike for every split
    count (Triton compiles a variant per divisibility of each integer: one here, not one per count).
    """
    if splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    batch, num_heads, head_dim = q.shape
    part = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, triton.cdiv(splits, 16) * 16, dtype=torch.float32, device=q.device)
    return part, lse, (part.stride(0), part.stride(1), part.stride(2)), (lse.stride(0), lse.stride(1))


def _merge_splits(out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor, *, block_d: int) -> None:
    """Merge the split partials of `_decode_kernel` into `out` by their log-sum-exps.

    Semantics:
        w[b, h, s] = 2 ** (lse[b, h, s] - max_s lse[b, h, s])  (an empty split has lse = -inf: weight 0)
        out[b, h] = sum_s w[b, h, s] * part[b, h, s] / sum_s w[b, h, s]

    Args:
        out: Shape `[B, H, D]`. Output, written in place.
        part: Shape `[B, H, S, D]`, fp32. Each split's softmax-normalised partial output.
        lse: Shape `[B, H, >= S]`, fp32. Each split's log2-sum-exp of its scaled scores (rows may be
            padded past `S`).
        block_d: Scalar. The head-dim tile (`D` padded to a power of two).
    """
    batch, num_heads, splits = part.shape[:3]
    _decode_merge_kernel[(batch, num_heads)](
        out,
        part,
        lse,
        part.shape[3],
        splits,
        out.stride(0),
        out.stride(1),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        # One tile for any split count the heuristic picks (<= 32): one compiled variant, not one per power.
        BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(splits)),
        BLOCK_D=block_d,
        num_warps=4,
    )
