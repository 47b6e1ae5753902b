"""CPU (torch) paths of the paged-attention kernels.

Decode gathers whole KV blocks (one index per block, not per token) for all sequences at once and runs a
single masked SDPA with the query heads of each KV head folded into the query-length axis (GQA without
copying K/V per query head). Prefill loops over sequences (a handful per step), gathers each sequence's
blocks and runs causal SDPA aligned to the end of its context, so a chunk attends to its cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    kvh, hd = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


def paged_attention_decode_torch(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    batch, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    max_ctx = int(context_lens.max())
    num_blocks = -(-max_ctx // block_size)
    tables = block_tables[:, :num_blocks].clamp_min(0)
    ctx = num_blocks * block_size
    k = k_cache[tables].view(batch, ctx, kvh, head_dim).transpose(1, 2)
    v = v_cache[tables].view(batch, ctx, kvh, head_dim).transpose(1, 2)
    mask = (torch.arange(ctx, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    qg = q.view(batch, kvh, group, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out.copy_(o.reshape(batch, num_heads, head_dim))


def paged_attention_prefill_torch(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    starts = query_start_loc.tolist()
    ctx_lens = context_lens.tolist()
    for i, ctx in enumerate(ctx_lens):
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        blocks = block_tables[i, : -(-ctx // block_size)]
        k = k_cache[blocks].view(-1, kvh, head_dim)[:ctx].transpose(0, 1)
        v = v_cache[blocks].view(-1, kvh, head_dim)[:ctx].transpose(0, 1)
        qi = q[s:e].transpose(0, 1)
        if q_len == ctx:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Bottom-right causal: query j sits at absolute position ctx - q_len + j.
            qpos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o.transpose(0, 1).reshape(q_len, num_heads, head_dim)
