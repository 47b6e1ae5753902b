"""Slow, obviously-correct references for the kernels (float64, per-token loops). Tests only."""

from __future__ import annotations

import torch


def sgmv_shrink_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: list[int],
    layer: int,
    scale: torch.Tensor,
    ranks: list[int] | None = None,
) -> torch.Tensor:
    """[T, R] float64: row t = scale[s] * x[t] @ A[layer, s, :r].T (zero past r, zero for s = -1)."""
    rank = lora_a.shape[2]
    y = torch.zeros(x.shape[0], rank, dtype=torch.float64)
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        r = ranks[s] if ranks is not None else rank
        y[t, :r] = float(scale[s]) * (x[t].double() @ lora_a[layer, s, :r].double().t())
    return y


def sgmv_expand_ref(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: list[int],
    layer: int,
    y_offset: int = 0,
    ranks: list[int] | None = None,
) -> torch.Tensor:
    """float64 copy of y with row t's slice += v[t, :r] @ B[layer, s, :, :r].T."""
    out = y.double().clone()
    n, rank = lora_b.shape[2], lora_b.shape[3]
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        r = ranks[s] if ranks is not None else rank
        out[t, y_offset : y_offset + n] += v[t, :r].double() @ lora_b[layer, s, :, :r].double().t()
    return out


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """float64 causal attention of queries at absolute `q_positions` over a contiguous context.

    q: [n, H, D]; k, v: [ctx, KVH, D]. Query i attends to context tokens lo..q_positions[i], where lo is
    0, or with a window the first key less than `sliding_window` positions back (`pos - j < window`).
    """
    heads, kvh = q.shape[1], k.shape[1]
    group = heads // kvh
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_positions):
        lo = max(0, pos - sliding_window + 1) if sliding_window is not None else 0
        for h in range(heads):
            kk = k[lo : pos + 1, h // group].double()
            vv = v[lo : pos + 1, h // group].double()
            w = torch.softmax(scale * (kk @ q[i, h].double()), dim=0)
            out[i, h] = w @ vv
    return out


def gather_context(cache: torch.Tensor, blocks: list[int], ctx: int) -> torch.Tensor:
    """The first `ctx` tokens stored along `blocks` of a `[NB, BS, KVH, D]` cache, as `[ctx, KVH, D]`."""
    return torch.cat([cache[b] for b in blocks], dim=0)[:ctx]
