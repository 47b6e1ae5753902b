"""Paged attention over a block table: KV write, decode (one query per sequence) and prefill
(many queries per sequence, causal, attending to a cached prefix). GQA throughout.

KV cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]` per layer, for K and V. A token's
slot is `block_id * block_size + offset`. The backend follows the tensors' device (see `kernels.backend`):
the Triton kernels of `kernels.attention_triton` on CUDA, `kernels.attention_torch` otherwise. The KV
write is one `index_copy_` on either device.
"""

from __future__ import annotations

import torch

from kernels.attention_torch import (
    paged_attention_decode_torch,
    paged_attention_prefill_torch,
    write_kv_torch,
)
from kernels.backend import use_triton


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
    write_kv_torch(k_cache, v_cache, k, v, slot_mapping)


def paged_attention_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """Decode attention: one query token per sequence over its whole paged context.

    Semantics:
        for b: K_b, V_b = the first context_lens[b] cached tokens along block_tables[b]
            out[b, h] = softmax(scale * q[b, h] @ K_b[:, h // G].T) @ V_b[:, h // G],  G = H / KVH

    Args:
        out: Shape `[B, H, D]`. Output, written in place.
        q: Shape `[B, H, D]`. One query per sequence (after RoPE).
        k_cache: Shape `[NB, BS, KVH, D]`. Key cache of this layer.
        v_cache: Shape `[NB, BS, KVH, D]`. Value cache of this layer.
        block_tables: Shape `[B, max_blocks]`, int64. Block ids per sequence; entries past the context
            are ignored (may be any value).
        context_lens: Shape `[B]`, int64. Tokens in each sequence's context, the query's own included.
        scale: Softmax scale, usually `D ** -0.5`.
    """
    if use_triton(q):
        from kernels.attention_triton import paged_attention_decode_triton

        paged_attention_decode_triton(out, q, k_cache, v_cache, block_tables, context_lens, scale)
    else:
        paged_attention_decode_torch(out, q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_attention_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """Prefill / chunked-prefill attention: each sequence's new queries over its cached prefix + itself.

    Semantics:
        for b: queries q[s[b]:s[b+1]] sit at the last n_b = s[b+1] - s[b] positions of a context of
            c_b = context_lens[b] tokens; query j attends to context tokens 0 .. c_b - n_b + j (causal).

    Args:
        out: Shape `[T, H, D]`. Output, written in place.
        q: Shape `[T, H, D]`. Queries of all prefill sequences, contiguous per sequence.
        k_cache: Shape `[NB, BS, KVH, D]`. Key cache of this layer (the new tokens already written).
        v_cache: Shape `[NB, BS, KVH, D]`. Value cache of this layer.
        block_tables: Shape `[B, max_blocks]`, int64. Block ids per sequence.
        query_start_loc: Shape `[B + 1]`, int64. Start of each sequence's queries in `q`.
        context_lens: Shape `[B]`, int64. Context length per sequence, the new tokens included.
        scale: Softmax scale.
    """
    args = (out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
    if use_triton(q):
        from kernels.attention_triton import paged_attention_prefill_triton

        paged_attention_prefill_triton(*args)
    else:
        paged_attention_prefill_torch(*args)
