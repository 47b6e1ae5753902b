"""Paged attention over a block table: KV write, decode (one query per sequence) and prefill
(many queries per sequence, causal, attending to a cached prefix). GQA throughout.

KV cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]` per layer, for K and V. A token's
slot is `block_id * block_size + offset`. The backend follows the tensors' device (see `kernels.backend`):
the Triton kernels of `kernels.attention_decode_triton` and `kernels.attention_prefill_triton` on CUDA; on
a CPU the native kernel (`kernels.attention_native`: decode, and prefill as one decode row per new token)
where it builds, and `kernels.attention_torch` for the rest. The KV write is one `index_copy_` per tensor,
or one native call on a CPU.

Sliding-window attention (Mistral, windowed Qwen2 layers) is the same causal attention with the keys
more than `sliding_window - 1` positions behind the query masked out: the query at position `p` sees keys
`p - sliding_window < j <= p`, which is transformers' `sliding_window_overlay` (`kv_idx > q_idx - window`).
Both backends skip the blocks wholly behind every query's window, so a windowed step reads O(window)
keys, but the cache still holds the whole context: freeing the blocks that fall out of the window (a
rolling block table) would cap KV memory too, and is not done here.
"""

from __future__ import annotations

import torch

from kernels.attention_meta import AttentionMeta
from kernels.attention_native import (
    paged_attention_decode_native,
    paged_attention_prefill_native,
    write_kv_native,
)
from kernels.attention_torch import (
    paged_attention_decode_torch,
    paged_attention_prefill_torch,
    write_kv_torch,
)
from kernels.backend import use_native, use_triton
from kernels.glue import rope_


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's new keys and values into their cache slots.

    Semantics:
        k_cache.view(-1, KVH, D)[slot_mapping[t]] = k[t];  same for v.

    Args:
        k_cache: Shape `[NB, BS, KVH, D]`. Key cache of one layer, updated in place.
        v_cache: Shape `[NB, BS, KVH, D]`. Value cache of one layer, updated in place.
        k: Shape `[T, KVH, D]`. New keys (after RoPE).
        v: Shape `[T, KVH, D]`. New values.
        slot_mapping: Shape `[T]`, int64. Flat cache slot of each token.
    """
    if use_native(k) and k_cache.is_contiguous() and v_cache.is_contiguous():
        write_kv_native(k_cache, v_cache, k, v, slot_mapping)
    else:
        write_kv_torch(k_cache, v_cache, k, v, slot_mapping)


def rope_write_kv(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """RoPE on a step's fused qkv rows, then their keys and values stored into the cache.

    Semantics:
        rope_(qkv, heads + kv_heads, head_dim, cos, sin, positions)   # q and k heads, in place
        write_kv(k_cache, v_cache, k, v, slot_mapping)   # k, v: the rows' key and value heads
    The native CPU kernel does both in one pass over the rows (the same bits); elsewhere the two calls.

    Args:
        qkv: Shape `[T, >= (H + 2 KVH) * D]`. The q, k and v heads of each token, updated in place.
        heads, kv_heads, head_dim: H, KVH and D.
        cos, sin: Shape `[max_positions, D]`. The RoPE tables, in qkv's dtype.
        positions: Shape `[T]`, int64. Each token's position.
        k_cache, v_cache: Shape `[NB, BS, KVH, D]`. One layer's caches, updated in place.
        slot_mapping: Shape `[T]`, int64. Flat cache slot of each token.
    """
    if use_native(qkv) and qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous():
        torch.ops.loragate_cpu.rope_write_kv(
            qkv, k_cache, v_cache, cos, sin, positions.contiguous(), slot_mapping.contiguous(),
            heads, kv_heads, head_dim,
        )  # fmt: skip
        return
    rope_(qkv, heads + kv_heads, head_dim, cos, sin, positions)
    t, q_size, kv_size = qkv.shape[0], heads * head_dim, kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].reshape(t, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].reshape(t, kv_heads, head_dim)
    write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Decode attention: one query token per sequence over its paged context (or the window's end of it).

    Semantics:
        for b: c = meta.context_lens[b];  lo = max(0, c - sliding_window) if sliding_window else 0
            K_b, V_b = cached tokens lo .. c - 1 along meta.block_tables[b]
            out[b, h] = softmax(scale * q[b, h] @ K_b[:, h // G].T) @ V_b[:, h // G],  G = H / KVH

    Args:
        out: Shape `[B, H, D]`. Output, written in place.
        q: Shape `[B, H, D]`. One query per sequence (after RoPE).
        k_cache: Shape `[NB, BS, KVH, D]`. Key cache of this layer.
        v_cache: Shape `[NB, BS, KVH, D]`. Value cache of this layer.
        meta: The decode group (`AttentionMeta`): `block_tables` `[B, max_blocks]` (entries past the
            context are ignored) and `context_lens` `[B]` (the query's own token included), int64.
        scale: Softmax scale, usually `D ** -0.5`.
        sliding_window: Scalar, `None` or `>= 1`. Keys the query sees, its own included (`None`: all).
    """
    check_window(sliding_window)
    if use_triton(q):
        from kernels.attention_decode_triton import paged_attention_decode_triton

        paged_attention_decode_triton(
            out, q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
        )
    elif use_native(q):
        paged_attention_decode_native(
            out, q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
        )
    else:
        paged_attention_decode_torch(
            out, q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
        )


def paged_attention_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Prefill / chunked-prefill attention: each sequence's new queries over its cached prefix + itself.

    Semantics:
        for b, s = meta.query_start_loc: queries q[s[b]:s[b+1]] sit at the last n_b = s[b+1] - s[b]
            positions of a context of c_b = meta.context_lens[b] tokens; query j, at position
            p = c_b - n_b + j, attends to context tokens max(0, p - sliding_window + 1) .. p (causal;
            from 0 when sliding_window is None).

    Args:
        out: Shape `[T, H, D]`. Output, written in place.
        q: Shape `[T, H, D]`. Queries of all prefill sequences, contiguous per sequence.
        k_cache: Shape `[NB, BS, KVH, D]`. Key cache of this layer (the new tokens already written).
        v_cache: Shape `[NB, BS, KVH, D]`. Value cache of this layer.
        meta: The prefill group (`AttentionMeta`): `block_tables` `[B, max_blocks]`, `query_start_loc`
            `[B + 1]` (required) and `context_lens` `[B]` (the new tokens included), int64.
        scale: Softmax scale.
        sliding_window: Scalar, `None` or `>= 1`. Keys each query sees, its own included (`None`: all).
    """
    check_window(sliding_window)
    if meta.query_start_loc is None:
        raise ValueError("prefill attention needs meta.query_start_loc")
    if use_triton(q):
        from kernels.attention_prefill_triton import paged_attention_prefill_triton

        paged_attention_prefill_triton(
            out, q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
        )
    elif use_native(q):
        paged_attention_prefill_native(
            out, q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
        )
    else:
        paged_attention_prefill_torch(
            out, q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
        )


def check_window(sliding_window: int | None) -> None:
    """Reject a window that would hide a query's own key (and leave its softmax empty)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
