"""The native CPU kernels' build and fallback (`kernels.native`), and the decode kernel on odd shapes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import AttentionMeta, native, paged_attention_decode, paged_attention_prefill
from kernels.backend import BACKEND_ENV, use_native
from tests.kernels.kernel_testing import (
    TOLERANCE,
    decode_meta,
    decode_reference,
    paged_kv,
    prefill_meta,
    prefill_reference,
    rel_err,
)


def test_the_kernels_build_here_and_are_used_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert native.available()
    assert native.library_path().exists()
    assert use_native(torch.zeros(1))
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert not use_native(torch.zeros(1))


# 32, 64 and 128: the register-blocked loops (several sequences a thread: each prefetches the next one's
# first block; bf16 scores from `vdpbf16ps` where the CPU has it); 80: the generic-size loop; 256: a size
# past 128. Query heads per KV head: 3; 1 (no GQA), 5 and 8 (the weighted values take 4 heads at a time).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("head_dim", "group"),
    [(32, 3), (64, 3), (80, 3), (128, 3), (256, 3), (64, 1), (64, 5), (128, 8), (32, 8)],
)
def test_decode_on_a_large_ragged_batch_with_shuffled_blocks(
    head_dim: int, group: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    gen = torch.Generator().manual_seed(head_dim + group)
    ctx_lens = torch.randint(1, 300, (37,), generator=gen).tolist()
    kv = paged_kv(ctx_lens, 16, 2, head_dim, dtype, gen)
    q = torch.randn(len(ctx_lens), 2 * group, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    meta = decode_meta(kv, ctx_lens)
    paged_attention_decode(out, q, kv.k, kv.v, meta, scale=head_dim**-0.5, sliding_window=None)
    assert rel_err(out, decode_reference(q, kv, ctx_lens, head_dim**-0.5, None)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("head_dim", "block_size", "window"), [(32, 16, None), (64, 32, None), (64, 8, 21)])
def test_decode_gives_a_sequence_the_same_bits_whatever_batch_it_is_in(
    head_dim: int, block_size: int, window: int | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy output must not depend on which other requests share the step: each sequence's scores and
    sums run in one order wherever it sits (alone, first, last, between others)."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    gen = torch.Generator().manual_seed(head_dim + block_size)
    ctx_lens = torch.randint(1, 200, (23,), generator=gen).tolist()
    kv = paged_kv(ctx_lens, block_size, 2, head_dim, dtype, gen)
    q = torch.randn(len(ctx_lens), 8, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    paged_attention_decode(out, q, kv.k, kv.v, decode_meta(kv, ctx_lens), scale=0.3, sliding_window=window)
    for i in (0, 11, 22):
        one = torch.empty_like(q[i : i + 1])
        meta = AttentionMeta(kv.block_tables[i : i + 1], torch.tensor(ctx_lens[i : i + 1]))
        paged_attention_decode(one, q[i : i + 1], kv.k, kv.v, meta, scale=0.3, sliding_window=window)
        assert torch.equal(one[0], out[i])


def test_a_prefill_group_as_one_row_per_query() -> None:
    """`AttentionMeta.per_query` on its docstring's example: contexts of 6 and 3, the last 2 and 3 new."""
    meta = AttentionMeta(
        torch.tensor([[7, 2], [5, 0]]), torch.tensor([6, 3]), query_start_loc=torch.tensor([0, 2, 5])
    )
    rows, lens = meta.per_query
    assert rows.tolist() == [0, 0, 1, 1, 1] and lens.tolist() == [5, 6, 1, 2, 3]


# A long prompt alone (its rows, one key longer each, shared out between the threads), beside a one-token
# chunk over a long prefix and a chunk over a short one; with and without a window.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("head_dim", "window"), [(64, None), (128, None), (80, None), (64, 37)])
def test_native_prefill_matches_the_reference_and_decode_bit_for_bit(
    head_dim: int, window: int | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each query's row is the decode kernel's row for that position: a request prefilled again after the
    tokens it streamed (a resumed request) attends exactly as its decode steps did."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    gen = torch.Generator().manual_seed(head_dim)
    q_lens, prefixes = [300, 1, 77], [0, 150, 33]
    ctx = [n + p for n, p in zip(q_lens, prefixes, strict=True)]
    kv = paged_kv(ctx, 16, 2, head_dim, dtype, gen)
    q = torch.randn(sum(q_lens), 6, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    meta = prefill_meta(kv, q_lens, ctx)
    paged_attention_prefill(out, q, kv.k, kv.v, meta, scale=scale, sliding_window=window)
    ref = prefill_reference(q, kv, q_lens, ctx, scale, window)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    for b, row in ((0, 0), (0, 299), (1, 300), (2, 377)):  # sequence, query row
        seen = row - sum(q_lens[:b]) + prefixes[b] + 1  # the query's position + 1
        one = torch.empty_like(q[:1])
        meta = AttentionMeta(kv.block_tables[b : b + 1], torch.tensor([seen]))
        paged_attention_decode(one, q[row : row + 1], kv.k, kv.v, meta, scale=scale, sliding_window=window)
        assert torch.equal(one[0], out[row])


def test_decode_into_a_strided_output_from_a_strided_query(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    gen = torch.Generator().manual_seed(1)
    ctx_lens = [5, 40, 17]
    kv = paged_kv(ctx_lens, 8, 2, 32, torch.float32, gen)
    wide = torch.randn(3, 4, 64, generator=gen)
    q = wide[..., :32]  # not contiguous
    out_wide = torch.full((3, 4, 64), float("nan"))
    out = out_wide[..., 32:]
    paged_attention_decode(out, q, kv.k, kv.v, decode_meta(kv, ctx_lens), scale=0.2)
    assert rel_err(out, decode_reference(q.contiguous(), kv, ctx_lens, 0.2, None)) < TOLERANCE[torch.float32]
    assert out_wide[..., :32].isnan().all()  # nothing written outside `out`


def test_without_a_compiler_the_torch_path_serves_and_native_is_refused(tmp_path: Path) -> None:
    code = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
import kernels
from kernels import native
from kernels.backend import use_native
print("available", native.available(), "auto", use_native(torch.zeros(1)))
import os
os.environ["LORAGATE_KERNEL_BACKEND"] = "native"
try:
    use_native(torch.zeros(1))
except RuntimeError as e:
    print("refused", e)
"""
    env = {
        "PATH": "/usr/bin:/bin",
        "CXX": "/bin/false",
        "LORAGATE_KERNEL_CACHE": str(tmp_path / "kernels"),
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "HOME": str(tmp_path),
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "available False auto False" in done.stdout
    assert "refused LORAGATE_KERNEL_BACKEND=native" in done.stdout
    assert "native CPU kernels unavailable, using the torch paths: /bin/false failed" in done.stderr
    assert not list((tmp_path / "kernels").rglob("*.so*"))  # no half-written library left behind
