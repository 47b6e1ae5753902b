"""The CPU paged-attention paths against the float64 reference: block sizes, GQA ratios, dtypes, windows.

Decode tests run twice: on the torch path and on the native C++ kernel (`kernels.native`, built here).
"""

from __future__ import annotations

import pytest
import torch

import kernels.attention_torch
from kernels import AttentionMeta, paged_attention_decode, paged_attention_prefill, write_kv
from kernels.backend import BACKEND_ENV
from tests.kernels.kernel_testing import (
    TOLERANCE,
    decode_meta,
    decode_reference,
    paged_kv,
    prefill_meta,
    prefill_reference,
    query_start_loc,
    rel_err,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GQA = [(4, 4), (8, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 4, 8


@pytest.fixture(params=["sdpa", "tiles", "native"])
def prefill_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a prefill test on every CPU prefill path: the torch backend's fused SDPA and its explicit query
    tiles, and the native kernel's decode rows (`kernels.attention_native`; fails if it cannot build)."""
    monkeypatch.setenv(BACKEND_ENV, "native" if request.param == "native" else "torch")
    threshold = 1 if request.param == "sdpa" else 10**9
    monkeypatch.setattr(kernels.attention_torch, "SDPA_MIN_QUERIES", threshold)
    return str(request.param)


def run_decode(
    ctx_lens: list[int],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = paged_kv(ctx_lens, block_size, heads[1], head_dim, dtype, gen)
    q = torch.randn(len(ctx_lens), heads[0], head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_attention_decode(out, q, kv.k, kv.v, decode_meta(kv, ctx_lens), scale=scale, sliding_window=window)
    return out, decode_reference(q, kv, ctx_lens, scale, window)


def run_prefill(
    q_lens: list[int],
    prefixes: list[int],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ctx = [n + p for n, p in zip(q_lens, prefixes, strict=True)]
    kv = paged_kv(ctx, block_size, heads[1], head_dim, dtype, gen)
    q = torch.randn(sum(q_lens), heads[0], head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    meta = prefill_meta(kv, q_lens, ctx)
    paged_attention_prefill(out, q, kv.k, kv.v, meta, scale=scale, sliding_window=window)
    return out, prefill_reference(q, kv, q_lens, ctx, scale, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-KVH{h[1]}")
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(
    block_size: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, cpu_backend: str
) -> None:
    # Lengths of 1 token, exact block multiples, and ragged ones; poisoned (NaN) output.
    ctx_lens = [1, block_size, 2 * block_size + 3, 70, 5, 3 * block_size]
    out, ref = run_decode(ctx_lens, block_size, heads, head_dim, dtype, seed=block_size + head_dim)
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_decode_reads_queries_sliced_from_fused_qkv_rows(cpu_backend: str) -> None:
    """q as the model passes it: the first heads of each fused qkv row (not contiguous)."""
    gen = torch.Generator().manual_seed(21)
    ctx_lens = [3, 17, 40]
    kv = paged_kv(ctx_lens, 16, 2, 32, torch.float32, gen)
    qkv = torch.randn(len(ctx_lens), (8 + 2 * 2) * 32, generator=gen)
    q = qkv[:, : 8 * 32].view(len(ctx_lens), 8, 32)
    assert not q.is_contiguous()
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(out, q, kv.k, kv.v, decode_meta(kv, ctx_lens), scale=0.2)
    assert rel_err(out, decode_reference(q, kv, ctx_lens, 0.2)) < TOLERANCE[torch.float32]


def test_decode_splits_a_large_batch_into_length_sorted_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels.attention_torch, "DECODE_GROUP_BYTES", 8 * 1024)
    gen = torch.Generator().manual_seed(3)
    ctx_lens = torch.randint(1, 120, (40,), generator=gen).tolist()
    out, ref = run_decode(ctx_lens, 16, (8, 2), 32, torch.float32, seed=4)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-KVH{h[1]}")
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    ("q_lens", "prefixes"),
    [([37], [0]), ([20, 1, 9], [45, 17, 0]), ([16, 33], [16, 64])],
    ids=["prefill", "chunked-with-prefix", "block-aligned"],
)
def test_prefill_matches_reference(
    q_lens: list[int],
    prefixes: list[int],
    block_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    prefill_path: str,
) -> None:
    out, ref = run_prefill(q_lens, prefixes, block_size, heads, 32, dtype, seed=sum(q_lens) + block_size)
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_prefill_query_tiles_meet_at_the_causal_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    monkeypatch.setattr(kernels.attention_torch, "SDPA_MIN_QUERIES", 10**9)
    monkeypatch.setattr(kernels.attention_torch, "PREFILL_TILE_BYTES", 1)  # 16-query tiles
    out, ref = run_prefill([50, 23], [0, 30], 16, (8, 2), 64, torch.float32, seed=9)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window", [None, 70])
def test_long_prefill_chunks_go_to_fused_sdpa(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the default threshold a long chunk (over a cached prefix, or not) runs in torch's SDPA, a short
    one in query tiles; both match the reference (the torch path: the native one takes every chunk)."""
    monkeypatch.setenv(BACKEND_ENV, "torch")
    calls: list[int] = []
    sdpa = kernels.attention_torch._sdpa_attention

    def spy(out: torch.Tensor, q: torch.Tensor, *args: object) -> None:
        calls.append(q.shape[0])
        sdpa(out, q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels.attention_torch, "_sdpa_attention", spy)
    long = kernels.attention_torch.SDPA_MIN_QUERIES
    out, ref = run_prefill([long, long + 7, 5], [0, 90, 40], 16, (8, 2), 64, torch.float32, 11, window)
    assert calls == [long, long + 7]
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


# Windows of one token (only the query itself), shorter than a block, block-aligned, and longer than
# some contexts (those see everything).
WINDOWS = [1, 5, 16, 40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_sliding_window_matches_reference(
    window: int, block_size: int, dtype: torch.dtype, cpu_backend: str
) -> None:
    ctx_lens = [1, window, window + 1, 2 * block_size + 3, 70, 5, 3 * block_size]
    out, ref = run_decode(ctx_lens, block_size, (8, 2), 32, dtype, seed=window + block_size, window=window)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    _, full = run_decode(ctx_lens, block_size, (8, 2), 32, dtype, seed=window + block_size)  # same inputs
    assert rel_err(out, full) > 10 * TOLERANCE[dtype]  # the window did hide keys


def test_decode_sliding_window_groups_sequences_of_different_first_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels.attention_torch, "DECODE_GROUP_BYTES", 8 * 1024)
    gen = torch.Generator().manual_seed(5)
    ctx_lens = torch.randint(1, 150, (40,), generator=gen).tolist()
    out, ref = run_decode(ctx_lens, 16, (8, 2), 32, torch.float32, seed=6, window=21)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(
    ("q_lens", "prefixes"),
    [([37], [0]), ([20, 1, 9], [45, 17, 0]), ([16, 33], [16, 64])],
    ids=["prefill", "chunked-with-prefix", "block-aligned"],
)
def test_prefill_sliding_window_matches_reference(
    q_lens: list[int],
    prefixes: list[int],
    window: int,
    block_size: int,
    dtype: torch.dtype,
    prefill_path: str,
) -> None:
    seed = sum(q_lens) + window
    out, ref = run_prefill(q_lens, prefixes, block_size, (8, 2), 32, dtype, seed=seed, window=window)
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_prefill_sliding_window_across_query_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    monkeypatch.setattr(kernels.attention_torch, "SDPA_MIN_QUERIES", 10**9)
    monkeypatch.setattr(kernels.attention_torch, "PREFILL_TILE_BYTES", 1)  # 16-query tiles
    out, ref = run_prefill([50, 23], [0, 30], 16, (8, 2), 64, torch.float32, seed=9, window=19)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_sliding_window_sees_keys_less_than_window_positions_back(
    phase: str, cpu_backend: str, prefill_path: str
) -> None:
    # transformers' Mistral mask keeps key j for query i when i - j < window (`kv_idx > q_idx - window`).
    # With q = 0 the softmax is uniform, and V[j] = j makes the output the mean of the positions seen.
    ctx, window = 10, 4
    kc = torch.randn(2, 8, 1, 16)
    vc = torch.arange(16, dtype=torch.float32).view(2, 8, 1, 1).expand(2, 8, 1, 16).contiguous()
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([ctx])
    if phase == "decode":
        out = torch.empty(1, 1, 16)
        meta = AttentionMeta(tables, lens)
        paged_attention_decode(out, torch.zeros(1, 1, 16), kc, vc, meta, scale=1.0, sliding_window=window)
    else:
        out, starts = torch.empty(ctx, 1, 16), torch.tensor([0, ctx])
        meta = AttentionMeta(tables, lens, query_start_loc=starts)
        paged_attention_prefill(out, torch.zeros_like(out), kc, vc, meta, scale=1.0, sliding_window=window)
        assert out[:, 0, 0].tolist() == [0.0, 0.5, 1.0, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5]
    assert float(out[-1, 0, 0]) == (6 + 7 + 8 + 9) / 4


def test_a_window_below_one_token_is_rejected() -> None:
    q = torch.zeros(1, 1, 16)
    cache = torch.zeros(1, 8, 1, 16)
    with pytest.raises(ValueError, match="sliding_window must be None or >= 1"):
        meta = AttentionMeta(torch.tensor([[0]]), torch.tensor([1]))
        paged_attention_decode(q.clone(), q, cache, cache, meta, scale=1.0, sliding_window=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_kv_stores_each_token_at_its_slot(dtype: torch.dtype, cpu_backend: str) -> None:
    """K and V read as slices of fused qkv rows (what the model passes), stored at their slots only."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(4, 8, 2, 16, dtype=dtype)
    v_cache = torch.zeros(4, 8, 2, 16, dtype=dtype)
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16, generator=gen).to(dtype)
    k = qkv[:, 64:96].reshape(3, 2, 16)
    v = qkv[:, 96:].reshape(3, 2, 16)
    assert not k.is_contiguous()
    write_kv(k_cache, v_cache, k, v, torch.tensor([0, 13, 31]))
    assert (
        torch.equal(k_cache[0, 0], k[0])
        and torch.equal(k_cache[1, 5], k[1])
        and torch.equal(k_cache[3, 7], k[2])
    )
    assert torch.equal(v_cache[1, 5], v[1]) and torch.equal(v_cache[3, 7], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3
    assert int((v_cache != 0).any(-1).any(-1).sum()) == 3


def test_write_kv_refuses_a_slot_outside_the_cache(cpu_backend: str) -> None:
    cache = torch.zeros(2, 4, 1, 8)
    k = torch.ones(1, 1, 8)
    with pytest.raises((RuntimeError, IndexError)):
        write_kv(cache, cache.clone(), k, k, torch.tensor([8]))
    assert not cache.any()


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window 5"])
def test_host_lengths_from_the_step_mean_no_layer_reads_the_device_back(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's builder gives the lengths as Python ints: no layer calls `.tolist()` (a device sync
    per layer on a GPU), and the results still match the float64 reference."""
    gen = torch.Generator().manual_seed(7)
    q_lens, ctx = [3, 1, 6], [9, 17, 6]
    kv = paged_kv(ctx, 8, 2, 32, torch.float32, gen)
    dec_q = torch.randn(len(ctx), 4, 32, generator=gen)
    pre_q = torch.randn(sum(q_lens), 4, 32, generator=gen)
    starts = query_start_loc(q_lens)
    decode = AttentionMeta(kv.block_tables, torch.tensor(ctx), host_context_lens=tuple(ctx))
    prefill = AttentionMeta(
        kv.block_tables,
        torch.tensor(ctx),
        query_start_loc=starts,
        host_context_lens=tuple(ctx),
        host_query_start_loc=tuple(starts.tolist()),
    )

    def no_read_back(self: torch.Tensor) -> list[object]:
        raise AssertionError("a layer read a tensor back to the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_read_back)
    dec_out, pre_out = torch.empty_like(dec_q), torch.empty_like(pre_q)
    for _ in range(3):  # every layer of a step shares the metadata
        paged_attention_decode(dec_out, dec_q, kv.k, kv.v, decode, scale=0.2, sliding_window=window)
        paged_attention_prefill(pre_out, pre_q, kv.k, kv.v, prefill, scale=0.2, sliding_window=window)
    monkeypatch.undo()
    assert rel_err(dec_out, decode_reference(dec_q, kv, ctx, 0.2, window)) < TOLERANCE[torch.float32]
    assert rel_err(pre_out, prefill_reference(pre_q, kv, q_lens, ctx, 0.2, window)) < TOLERANCE[torch.float32]


def test_lengths_read_back_once_per_meta_when_the_builder_gave_none() -> None:
    meta = AttentionMeta(torch.zeros(3, 2, dtype=torch.int64), torch.tensor([4, 9, 4]))
    lens, order = meta.by_length
    assert lens == (9, 4, 4) and order.tolist() == [1, 0, 2]  # longest first, ties in batch order
    assert meta.by_length is meta.by_length and meta.context_lens_list == (4, 9, 4)
