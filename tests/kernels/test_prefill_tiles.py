"""Prefill attention with a prompt's rows on AMX tiles (`kernels/csrc/prefill_tiles.h`, op
`paged_prefill_prompt`, reached through `paged_attention_prefill` when the group carries prompt lengths):
within bf16 tolerance of float64, each row's bits its own whatever chunk or batch it comes in, and every
row that is not a prompt row (or cannot run on tiles) exactly the decode kernel's row."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kernels import AttentionMeta, native, paged_attention_decode, paged_attention_prefill
from kernels.backend import BACKEND_ENV
from kernels.sgmv_native import amx_ready
from tests.kernels.kernel_testing import (
    TOLERANCE,
    PagedKV,
    paged_kv,
    prefill_meta,
    prefill_reference,
    rel_err,
)

needs_amx = pytest.mark.skipif(not amx_ready(), reason="no AMX tiles on this CPU (or not granted)")
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    assert native.available()


def with_prompts(meta: AttentionMeta, prompt_lens: list[int]) -> AttentionMeta:
    return replace(meta, prompt_lens=torch.tensor(prompt_lens, dtype=torch.int64))


def poison_past_contexts(kv: PagedKV, ctx_lens: list[int]) -> None:
    """NaN in every cached row past each sequence's context (its last block's unwritten rows)."""
    bs = kv.k.shape[1]
    for table, c in zip(kv.tables, ctx_lens, strict=True):
        if c % bs:
            kv.k[table[-1], c % bs :] = float("nan")
            kv.v[table[-1], c % bs :] = float("nan")


def prefill(
    q: torch.Tensor, kv: PagedKV, meta: AttentionMeta, scale: float, window: int | None = None
) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill(out, q, kv.k, kv.v, meta, scale=scale, sliding_window=window)
    return out


def test_the_tiles_are_taken_for_bf16_head_sizes_32_64_128_where_amx_runs() -> None:
    ready = torch.ops.loragate_cpu.prefill_tiles_ready
    for dim in (32, 64, 128):
        assert ready(BF16, dim) == amx_ready()
    assert not ready(BF16, 80) and not ready(torch.float32, 64) and not ready(torch.float16, 64)


@needs_amx
@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"), [(64, 3, 16), (32, 4, 16), (128, 1, 16), (64, 2, 8), (128, 5, 32)]
)
def test_prompt_rows_match_float64_over_cached_prefixes(head_dim: int, group: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(head_dim * group + block_size)
    # chunks of 1-300 rows after cached prefixes of 0-140 tokens: partial tiles, several tasks a sequence
    q_lens = [1, 300, 17, 16, 33, 130, 5, 64]
    cached = [0, 0, 140, 3, 77, 15, 0, 129]
    ctx_lens = [n + c for n, c in zip(q_lens, cached, strict=True)]
    kv = paged_kv(ctx_lens, block_size, 2, head_dim, BF16, gen)
    poison_past_contexts(kv, ctx_lens)
    q = torch.randn(sum(q_lens), 2 * group, head_dim, generator=gen).to(BF16)
    scale = head_dim**-0.5
    out = prefill(q, kv, with_prompts(prefill_meta(kv, q_lens, ctx_lens), ctx_lens), scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, prefill_reference(q, kv, q_lens, ctx_lens, scale)) < TOLERANCE[BF16]


@needs_amx
def test_a_prompt_row_has_the_same_bits_whatever_its_chunk_and_batch() -> None:
    """A prompt's rows computed whole, then in random chunks after cached prefixes with the other
    sequences in shuffled order: every row bit for bit the same (the tiles' sums over a row's own keys in
    a fixed order, zeros past them)."""
    gen = torch.Generator().manual_seed(7)
    lens = [211, 37, 90, 16, 150]
    kv = paged_kv(lens, 16, 3, 64, BF16, gen)
    qs = [torch.randn(n, 9, 64, generator=gen).to(BF16) for n in lens]
    whole_meta = with_prompts(prefill_meta(kv, lens, lens), lens)
    whole = prefill(torch.cat(qs), kv, whole_meta, 0.125).split(lens)
    rng = random.Random(3)
    for _ in range(12):
        order = rng.sample(range(len(lens)), len(lens))
        cuts = [(f, rng.randint(1, lens[b] - f)) for b in order for f in [rng.randint(0, lens[b] - 1)]]
        sub = replace(kv, block_tables=kv.block_tables[order], tables=[kv.tables[b] for b in order])
        q_lens, ctx = [n for _, n in cuts], [f + n for f, n in cuts]
        q = torch.cat([qs[b][f : f + n] for b, (f, n) in zip(order, cuts, strict=True)])
        got = prefill(q, sub, with_prompts(prefill_meta(sub, q_lens, ctx), [lens[b] for b in order]), 0.125)
        for b, (f, n), rows in zip(order, cuts, got.split(q_lens), strict=True):
            assert torch.equal(rows, whole[b][f : f + n]), (b, f, n)


def decode_rows(
    q: torch.Tensor, kv: PagedKV, seq: list[int], positions: list[int], scale: float, window: int | None
) -> torch.Tensor:
    """Each row of q as the decode kernel's row of sequence seq[i] at positions[i]."""
    meta = AttentionMeta(kv.block_tables[seq], torch.tensor([p + 1 for p in positions]))
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(out, q, kv.k, kv.v, meta, scale=scale, sliding_window=window)
    return out


@pytest.mark.parametrize("window", [None, 40])
def test_rows_past_the_prompt_or_the_window_are_the_decode_kernel_rows(window: int | None) -> None:
    """A resumed request's generated tokens (positions from its prompt length on) and, with a window, rows
    at or past it attend exactly as their decode steps did; the prompt rows below the window are within
    tolerance of float64 (on tiles where AMX runs)."""
    gen = torch.Generator().manual_seed(11)
    q_lens, ctx_lens, prompt_lens = [60, 25, 9], [60, 70, 12], [44, 50, 12]
    kv = paged_kv(ctx_lens, 16, 2, 64, BF16, gen)
    q = torch.randn(sum(q_lens), 6, 64, generator=gen).to(BF16)
    out = prefill(q, kv, with_prompts(prefill_meta(kv, q_lens, ctx_lens), prompt_lens), 0.125, window)
    ref = prefill_reference(q, kv, q_lens, ctx_lens, 0.125, window)
    seq = [b for b, n in enumerate(q_lens) for _ in range(n)]
    pos = [p for n, c in zip(q_lens, ctx_lens, strict=True) for p in range(c - n, c)]
    limit = [min(prompt_lens[b], window or 1 << 30) for b in seq]
    past = torch.tensor([p >= lim for p, lim in zip(pos, limit, strict=True)])
    assert 0 < int(past.sum()) < len(pos)
    decoded = decode_rows(q, kv, seq, pos, 0.125, window)
    assert torch.equal(out[past], decoded[past])
    assert rel_err(out[~past], ref[~past]) < TOLERANCE[BF16]


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 64), (BF16, 80), (torch.float16, 64)])
def test_rows_that_cannot_run_on_tiles_are_all_decode_rows(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    q_lens, ctx_lens = [30, 7], [45, 7]
    kv = paged_kv(ctx_lens, 16, 2, head_dim, dtype, gen)
    q = torch.randn(sum(q_lens), 4, head_dim, generator=gen).to(dtype)
    meta = prefill_meta(kv, q_lens, ctx_lens)
    got = prefill(q, kv, with_prompts(meta, ctx_lens), head_dim**-0.5)
    assert torch.equal(got, prefill(q, kv, meta, head_dim**-0.5))


def test_metadata_that_does_not_fit_is_refused() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = paged_kv([20], 16, 1, 64, BF16, gen)
    q = torch.randn(20, 2, 64, generator=gen).to(BF16)
    op = torch.ops.loragate_cpu.paged_prefill_prompt
    one = torch.tensor([20])

    def call(starts: list[int], tables: torch.Tensor = kv.block_tables) -> None:
        op(torch.empty_like(q), q, kv.k, kv.v, tables, torch.tensor(starts), one, one, 0.125, 0)

    with pytest.raises(RuntimeError, match="span q's rows"):
        call([0, 19])
    if amx_ready():
        with pytest.raises(RuntimeError, match="outside the cache"):
            call([0, 20], torch.tensor([[kv.tables[0][0], 10_000]]))
