"""CPU (torch) paths of the paged-attention kernels.

Both paths gather whole KV blocks (one index per block, not per token) and fold the `G` query heads of
each KV head into one matrix (GQA without copying K/V per query head). `loadtest.bench_kernels` drove
two choices:

- Decode works on groups of sequences sorted by context length, each group's gathered K/V kept near
  `DECODE_GROUP_BYTES`. One padded gather for the whole batch allocates tens of MB per layer, and on this
  machine fresh large buffers cost more in page faults than the attention itself; similar lengths per
  group also keep the padding small.
- Prefill of `SDPA_MIN_QUERIES` or more new tokens goes to torch's fused CPU SDPA (flash attention with
  GQA, `is_causal` or a bottom-right causal / band mask). With torch 2.13 on 2 threads, against explicit
  matmuls: bf16 1.9-3.4× faster, fp32 ~2× with head dim 32 (the tiny model) and on par with 64
  (SmolLM2: 0.85-1.5× over 256-2,048 queries, within this machine's noise; `bench_kernels` shapes). Shorter
  chunks run explicit matmul → softmax → matmul over query tiles, visiting only the keys at or before
  each tile's last query (a cached prefix plus the causal part of the chunk): faster there for wide
  heads. Scores and softmax are fp32; with bf16 storage the probabilities multiply V in bf16, as the
  Triton kernel does.

A sliding window only changes which blocks are gathered (those holding a key some query can see) and
adds a band mask; the softmax and matmuls are the same. fp16 storage is computed in fp32 in both paths:
fp16 matmuls are slow on CPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_meta import AttentionMeta

# Gathered K+V bytes per decode group: about half of one core's L2 here.
DECODE_GROUP_BYTES = 1 << 20
# fp32 score bytes per prefill query tile.
PREFILL_TILE_BYTES = 2 << 20
# New tokens from which a sequence's prefill attention runs in torch's fused SDPA.
SDPA_MIN_QUERIES = 64


def write_kv_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    kvh, hd = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float16 else dtype


def _decode_groups(spans: list[int], block_bytes: int) -> list[tuple[int, int]]:
    """`[start, end)` runs of the batch (sorted by context length, descending), each gathering about
    `DECODE_GROUP_BYTES`; `spans` are the blocks each sequence gathers."""
    groups = []
    start = 0
    while start < len(spans):
        size = max(1, DECODE_GROUP_BYTES // max(1, spans[start] * block_bytes))
        groups.append((start, min(len(spans), start + size)))
        start += size
    return groups


def _first_block(first_query: int, block_size: int, sliding_window: int | None) -> int:
    """The block holding the earliest key that a sequence's first query (at `first_query`) sees."""
    return max(0, first_query - sliding_window + 1) // block_size if sliding_window is not None else 0


def paged_attention_decode_torch(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    block_tables, context_lens = meta.block_tables, meta.context_lens
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    dtype = _compute_dtype(q.dtype)
    lens, order = meta.by_length  # once per step, shared by every layer
    firsts = [_first_block(c - 1, block_size, sliding_window) for c in lens]
    spans = [-(-c // block_size) - f for c, f in zip(lens, firsts, strict=True)]
    block_bytes = 2 * k_cache[0].numel() * k_cache.element_size()
    for start, end in _decode_groups(spans, block_bytes):
        n = end - start
        idx = order[start:end]
        num_blocks = max(spans[start:end])
        ctx = num_blocks * block_size
        tables = block_tables.index_select(0, idx)
        pos = torch.arange(ctx, device=q.device)  # cache position of each gathered key, per sequence
        if sliding_window is None:
            tables = tables[:, :num_blocks]
        else:
            first = torch.tensor(firsts[start:end], dtype=torch.int64, device=q.device)
            cols = first[:, None] + torch.arange(num_blocks, device=q.device)
            tables = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
            pos = pos + first[:, None] * block_size
        # Entries past a shorter sequence's context may hold anything: clamp them to a real block.
        tables = tables.clamp(0, k_cache.shape[0] - 1).reshape(-1)
        k = k_cache.index_select(0, tables).view(n, ctx, kvh, head_dim).transpose(1, 2).to(dtype)
        v = v_cache.index_select(0, tables).view(n, ctx, kvh, head_dim).transpose(1, 2).to(dtype)
        qg = q.index_select(0, idx).view(n, kvh, group, head_dim).to(dtype)
        mask = None
        if sliding_window is not None or lens[end - 1] < ctx:
            c = context_lens.index_select(0, idx)[:, None]
            seen = pos < c if sliding_window is None else (pos < c) & (pos >= c - sliding_window)
            mask = seen[:, None, None, :]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        out.index_copy_(0, idx, o.reshape(n, num_heads, head_dim).to(out.dtype))


def _causal_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    tile: int,
    sliding_window: int | None,
) -> None:
    """One sequence: queries `q [n, H, D]` are the last n of the context `k, v [ctx, KVH, D]`."""
    n, num_heads, head_dim = q.shape
    ctx, kvh = k.shape[0], k.shape[1]
    group = num_heads // kvh
    kt = k.permute(1, 2, 0).float()  # [KVH, D, ctx]
    pv_dtype = _compute_dtype(v.dtype)
    vv = v.transpose(0, 1).to(pv_dtype)  # [KVH, ctx, D]
    for s in range(0, n, tile):
        t = min(n, s + tile) - s
        first_q = ctx - n + s  # the tile's first query position
        hi = first_q + t  # keys up to the tile's last query
        lo = max(0, first_q - sliding_window + 1) if sliding_window is not None else 0
        qt = (q[s : s + t].float() * scale).view(t, kvh, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(qt.reshape(kvh, group * t, head_dim), kt[:, :, lo:hi]).view(kvh, group, t, hi - lo)
        # Within the tile's last t keys, query i sees keys 0..i (bottom-right aligned causal mask).
        diag = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., hi - lo - t :].masked_fill_(diag, float("-inf"))
        if sliding_window is not None:
            keys = torch.arange(lo, hi, device=q.device)
            queries = torch.arange(first_q, hi, device=q.device)
            scores.masked_fill_(keys[None, :] <= queries[:, None] - sliding_window, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(pv_dtype).view(kvh, group * t, hi - lo)
        o = torch.bmm(probs, vv[:, lo:hi]).view(kvh, group, t, head_dim).permute(2, 0, 1, 3)
        out[s : s + t] = o.reshape(t, num_heads, head_dim)


def _sdpa_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """One sequence in torch's fused SDPA: queries `q [n, H, D]` are the last n of `k, v [ctx, KVH, D]`."""
    n, ctx = q.shape[0], k.shape[0]
    dtype = _compute_dtype(q.dtype)
    qq, kk, vv = (x.transpose(0, 1).unsqueeze(0).to(dtype) for x in (q, k, v))
    mask = None
    if n != ctx or sliding_window is not None:
        # Query i sits at key position ctx - n + i: it sees keys up to there (bottom-right causal), and
        # with a window only the last `sliding_window` of them.
        pos = torch.arange(ctx, device=q.device)
        last = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = pos <= last
        if sliding_window is not None:
            mask &= pos > last - sliding_window
    o = F.scaled_dot_product_attention(
        qq, kk, vv, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    out.copy_(o[0].transpose(0, 1))


def paged_attention_prefill_torch(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    assert meta.query_start_loc is not None  # checked by `kernels.attention.paged_attention_prefill`
    block_tables = meta.block_tables
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    starts, ctx_lens = meta.query_start_list, meta.context_lens_list  # host copies, once per step
    for i, ctx in enumerate(ctx_lens):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        first = _first_block(ctx - (e - s), block_size, sliding_window)
        blocks = block_tables[i, first : -(-ctx // block_size)]
        # Positions are shifted by the skipped blocks; the masks depend only on query - key distances.
        span = ctx - first * block_size
        k = k_cache.index_select(0, blocks).view(-1, kvh, head_dim)[:span]
        v = v_cache.index_select(0, blocks).view(-1, kvh, head_dim)[:span]
        if e - s >= SDPA_MIN_QUERIES:
            _sdpa_attention(out[s:e], q[s:e], k, v, scale, sliding_window)
            continue
        keys = min(span, sliding_window) if sliding_window is not None else span
        tile = max(16, min(256, PREFILL_TILE_BYTES // (4 * num_heads * keys)))
        _causal_attention(out[s:e], q[s:e], k, v, scale, tile, sliding_window)
