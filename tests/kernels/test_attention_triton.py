"""The Triton paged-attention kernels against the float64 reference (GPU, or interpreted on CPU), with and
without a sliding window."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention_decode, paged_attention_prefill
from tests.kernels.kernel_testing import (
    TOLERANCE,
    PagedKV,
    decode_meta,
    decode_reference,
    paged_kv,
    prefill_meta,
    prefill_reference,
    rel_err,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GQA = [(4, 4), (4, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 2, 8


def decode_inputs(
    ctx_lens: list[int], block_size: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[PagedKV, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = paged_kv(ctx_lens, block_size, heads[1], head_dim, dtype, gen)
    return kv, torch.randn(len(ctx_lens), heads[0], head_dim, generator=gen).to(dtype)


def prefill_inputs(
    q_lens: list[int],
    ctx: list[int],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[PagedKV, torch.Tensor]:
    gen = torch.Generator().manual_seed(block_size + sum(q_lens) + sum(ctx))
    kv = paged_kv(ctx, block_size, heads[1], head_dim, dtype, gen)
    return kv, torch.randn(sum(q_lens), heads[0], head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-KVH{h[1]}")
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(
    block_size: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, device: str
) -> None:
    ctx_lens = [1, block_size, 2 * block_size + 3, 37]
    kv, q = decode_inputs(ctx_lens, block_size, heads, head_dim, dtype, seed=block_size + heads[1] + head_dim)
    d = kv.on(device)
    out = torch.full_like(q, float("nan"), device=device)
    scale = head_dim**-0.5
    paged_attention_decode(out, q.to(device), d.k, d.v, decode_meta(kv, ctx_lens, device), scale=scale)
    assert rel_err(out.cpu(), decode_reference(q, kv, ctx_lens, scale)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("block_n", "num_splits"), [(16, 1), (16, 3), (32, 2)])
def test_decode_split_kv_merges_partials(
    block_n: int, num_splits: int, dtype: torch.dtype, device: str
) -> None:
    from kernels.attention_decode_triton import paged_attention_decode_triton

    # Context 5 leaves some splits empty; 70 gives every split several tiles.
    ctx_lens = [5, 70, 33]
    kv, q = decode_inputs(ctx_lens, 16, (8, 2), 16, dtype, seed=num_splits)
    d = kv.on(device)
    out = torch.full_like(q, float("nan"), device=device)
    tiles = {"block_n": block_n, "num_splits": num_splits}
    meta = decode_meta(kv, ctx_lens, device)
    paged_attention_decode_triton(out, q.to(device), d.k, d.v, meta, scale=0.25, **tiles)
    assert rel_err(out.cpu(), decode_reference(q, kv, ctx_lens, 0.25)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-KVH{h[1]}")
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize(
    ("q_lens", "prefixes"),
    [([19], [0]), ([9, 1, 20], [23, 16, 0])],
    ids=["prefill", "chunked-with-prefix"],
)
def test_prefill_matches_reference(
    q_lens: list[int],
    prefixes: list[int],
    block_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    device: str,
) -> None:
    ctx = [n + p for n, p in zip(q_lens, prefixes, strict=True)]
    kv, q = prefill_inputs(q_lens, ctx, block_size, heads, 32, dtype)
    d = kv.on(device)
    out = torch.full_like(q, float("nan"), device=device)
    meta = prefill_meta(kv, q_lens, ctx, device)
    paged_attention_prefill(out, q.to(device), d.k, d.v, meta, scale=32**-0.5)
    assert rel_err(out.cpu(), prefill_reference(q, kv, q_lens, ctx, 32**-0.5)) < TOLERANCE[dtype]


def test_prefill_small_tiles_cover_several_query_and_key_tiles(device: str) -> None:
    from kernels.attention_prefill_triton import paged_attention_prefill_triton

    q_lens, ctx = [40, 3], [40, 50]
    kv, q = prefill_inputs(q_lens, ctx, 16, (4, 2), 24, torch.float32)  # head_dim 24: a masked 32-wide tile
    d = kv.on(device)
    out = torch.full_like(q, float("nan"), device=device)
    tiles = {"block_m": 16, "block_n": 16}
    meta = prefill_meta(kv, q_lens, ctx, device)
    paged_attention_prefill_triton(out, q.to(device), d.k, d.v, meta, scale=0.2, **tiles)
    assert rel_err(out.cpu(), prefill_reference(q, kv, q_lens, ctx, 0.2)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("window", "num_splits"), [(1, None), (7, None), (20, 1), (20, 3), (64, 2)])
def test_decode_sliding_window_matches_reference(
    window: int, num_splits: int | None, dtype: torch.dtype, device: str
) -> None:
    from kernels.attention_decode_triton import paged_attention_decode_triton

    # Contexts shorter than, equal to and longer than the window; 3 splits of a 20-token window leave
    # one empty.
    ctx_lens = [1, window, 70, 33, 5]
    kv, q = decode_inputs(ctx_lens, 16, (8, 2), 32, dtype, seed=window)
    d = kv.on(device)
    out = torch.full_like(q, float("nan"), device=device)
    knobs = {"sliding_window": window, "block_n": 16, "num_splits": num_splits}
    meta = decode_meta(kv, ctx_lens, device)
    paged_attention_decode_triton(out, q.to(device), d.k, d.v, meta, scale=0.2, **knobs)
    ref = decode_reference(q, kv, ctx_lens, 0.2, window)
    assert rel_err(out.cpu(), ref) < TOLERANCE[dtype]
    assert rel_err(out.cpu(), decode_reference(q, kv, ctx_lens, 0.2)) > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_prefill_sliding_window_matches_reference(window: int, dtype: torch.dtype, device: str) -> None:
    # 16-wide tiles: with a window of 1 or 5, rows see no key in their first key tile.
    q_lens, ctx = [40, 3, 9], [40, 50, 30]
    kv, q = prefill_inputs(q_lens, ctx, 8, (4, 2), 32, dtype)
    d = kv.on(device)
    out = torch.full_like(q, float("nan"), device=device)
    meta = prefill_meta(kv, q_lens, ctx, device)
    paged_attention_prefill(out, q.to(device), d.k, d.v, meta, scale=0.2, sliding_window=window)
    ref = prefill_reference(q, kv, q_lens, ctx, 0.2, window)
    assert rel_err(out.cpu(), ref) < TOLERANCE[dtype]


def test_prefill_sliding_window_small_tiles(device: str) -> None:
    from kernels.attention_prefill_triton import paged_attention_prefill_triton

    q_lens, ctx = [40, 3], [40, 50]
    kv, q = prefill_inputs(q_lens, ctx, 16, (4, 2), 24, torch.float32)
    d = kv.on(device)
    out = torch.full_like(q, float("nan"), device=device)
    knobs = {"sliding_window": 3, "block_m": 16, "block_n": 16}
    meta = prefill_meta(kv, q_lens, ctx, device)
    paged_attention_prefill_triton(out, q.to(device), d.k, d.v, meta, scale=0.2, **knobs)
    assert rel_err(out.cpu(), prefill_reference(q, kv, q_lens, ctx, 0.2, 3)) < TOLERANCE[torch.float32]


def test_tiles_below_the_gpu_dot_minimum_are_rejected(device: str) -> None:
    from kernels.attention_decode_triton import paged_attention_decode_triton
    from kernels.attention_prefill_triton import paged_attention_prefill_triton

    kv, q = decode_inputs([4], 16, (2, 1), 16, torch.float32, seed=0)
    d, q = kv.on(device), q.to(device)
    decode, prefill = decode_meta(kv, [4], device), prefill_meta(kv, [1], [4], device)
    with pytest.raises(ValueError, match="BLOCK_N"):
        paged_attention_decode_triton(q.clone(), q, d.k, d.v, decode, scale=1.0, block_n=8)
    with pytest.raises(ValueError, match="BLOCK_M"):
        paged_attention_prefill_triton(q.clone(), q, d.k, d.v, prefill, scale=1.0, block_m=8)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 17, 32])
def test_decode_targets_strides_specialise_alike_for_every_split_count(splits: int) -> None:
    """Triton compiles a variant per divisibility-by-16 of each integer argument: the split targets' strides
    must not change it with the split count, or a serving step meets a compile the warm-up did not run."""
    from kernels.attention_decode_triton import _decode_targets

    q = torch.zeros(5, 6, 64)
    out = torch.empty_like(q)
    part, lse, part_strides, lse_strides = _decode_targets(out, q, splits)
    assert all(s % 16 == 0 for s in (*part_strides, *lse_strides)), (part_strides, lse_strides)
    if splits > 1:
        assert part.shape == (5, 6, splits, 64) and lse.shape[:2] == (5, 6) and lse.shape[2] >= splits
