# mypy: allow-untyped-defs
# (@triton.jit kernels take untyped pointers and scalars; their wrapper below is typed.)
"""Triton paged prefill attention (the GPU backend of `kernels.attention.paged_attention_prefill`).

One program per (query tile, sequence, query head) walks the context in tiles of `BLOCK_N` token
positions with an online softmax in the log2 domain (`exp2`), fp32 throughout; each position's cache row
is found through the block table (`block_tables[b, pos // BS]`, offset `pos % BS`), so any block size
works. Queries sit at the end of their context (a chunk after its cached prefix), so the causal bound is
`pos <= c_b - n_b + j`; tiles past the diagonal are never visited. The grid is sized by the total token
count (no host sync for the longest sequence); tiles past a sequence's queries return at once.

A sliding window `W` starts the walk at the tile's first query minus `W - 1` and masks `pos <= q_pos - W`
per row. A row may then see no key in its first tiles, so the running max is read through `m_safe` (0
while still -inf). Without a window the kernel gets `NO_WINDOW`, larger than any context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_meta import AttentionMeta
from kernels.triton_util import (
    LOG2E,
    NO_WINDOW,
    dot_flags,
    kv_cache_strides,
    mma,
    pow2_tile,
    require_dot_tiles,
    require_unit_last_stride,
)


# The block table's width takes many values: not specialized on (a variant for 1 and for multiples of 16).
@triton.jit(do_not_specialize=["stride_btb"])
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
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = meta.context_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    require_unit_last_stride(out=out, q=q, k_cache=k_cache, v_cache=v_cache)
    bm, bn, bd = _prefill_tiles(q, block_m, block_n)
    upcast, precision = dot_flags(q.dtype)
    _prefill_kernel[(triton.cdiv(num_tokens, bm), batch, num_heads)](
        out,
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.context_lens,
        scale * LOG2E,
        sliding_window or NO_WINDOW,
        num_heads // kv_heads,
        head_dim,
        block_size,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_cache_strides(k_cache, v_cache),
        meta.block_tables.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=4,
        num_stages=2,
    )


def _prefill_tiles(q: torch.Tensor, block_m: int | None, block_n: int | None) -> tuple[int, int, int]:
    """`(BLOCK_M, BLOCK_N, BLOCK_D)`: query rows, context positions and head dim of one program's tiles."""
    num_tokens, _, head_dim = q.shape
    bd = pow2_tile(head_dim, hi=256)
    # Wide heads and fp32 operands get smaller tiles: a program's q, K and V tiles must fit in shared memory.
    bm = block_m or pow2_tile(num_tokens, hi=64 if bd <= 128 else 32)
    bn = block_n or (64 if q.dtype != torch.float32 and bd <= 128 else 32)
    require_dot_tiles(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    return bm, bn, bd
