"""The per-layer glue ops (`kernels.glue`): the native CPU kernels against the torch ops they replace,
which compute what Hugging Face Llama computes (the engine's token-for-token reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import add_rms_norm, rope_, rope_write_kv, silu_mul
from kernels.backend import BACKEND_ENV
from kernels.glue import argmax_rows, rms_norm_torch, rope_torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest difference allowed, in units of the dtype's epsilon times the value's magnitude: fp32 sums in
# another order (RMS) or another exp (SiLU); 16-bit values are rounded twice (normalized, then weighted),
# each rounding may land one step apart.
ULPS = {torch.float32: 8, torch.bfloat16: 2, torch.float16: 2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    eps = torch.finfo(dtype).eps
    bound = ULPS[dtype] * eps * b.float().abs().clamp(min=1e-3)
    return bool(((a.float() - b.float()).abs() <= bound).all())


def native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(
    dtype: torch.dtype, with_delta: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(1)
    h = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(37, 576, generator=gen).to(dtype) if with_delta else None
    w = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    expect_h = h + delta if delta is not None else h.clone()
    expect = rms_norm_torch(expect_h, w, 1e-5)
    native(monkeypatch)
    got_h, got = add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(got_h, expect_h)  # the residual add rounds exactly as torch's
    assert close(got, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_matches_torch_exactly(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(2)
    heads, dim, extra = 12, 64, 192  # q and k heads, then v's columns, which must stay untouched
    x = torch.randn(23, heads * dim + extra, generator=gen).to(dtype)
    cos = torch.randn(300, dim, generator=gen).to(dtype)
    sin = torch.randn(300, dim, generator=gen).to(dtype)
    positions = torch.randint(0, 300, (23,), generator=gen)
    part = x[:, : heads * dim].view(23, heads, dim)
    expect = rope_torch(part, cos[positions][:, None, :], sin[positions][:, None, :]).reshape(23, -1)
    tail = x[:, heads * dim :].clone()
    native(monkeypatch)
    rope_(x, heads, dim, cos, sin, positions)
    assert torch.equal(x[:, : heads * dim], expect)
    assert torch.equal(x[:, heads * dim :], tail)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_torch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(19, 2 * 1536, generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    expect = torch.nn.functional.silu(gate) * up
    native(monkeypatch)
    assert close(silu_mul(gate_up), expect, dtype)


def same_vector_exp_as_torch() -> bool:
    """Whether the native build calls the SLEEF exp torch's SiLU calls: torch dispatches to AVX-512 (or
    AVX2) kernels, and the native build (-march=native) sees the same widest vector ISA."""
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    capability = torch.backends.cpu.get_cpu_capability()
    return (capability == "AVX512" and " avx512f" in flags) or (
        capability == "AVX2" and " avx512f" not in flags
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_is_bit_identical_to_torch_on_its_vector_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 SiLU equals torch's bit for bit (its exp, its formula); in 16-bit, after the same rounding
    points, too (bf16 stores round the fp32 results the same way)."""
    if not same_vector_exp_as_torch():
        pytest.skip("torch's SiLU runs another exp on this CPU")
    gen = torch.Generator().manual_seed(8)
    gate_up = (torch.randn(37, 2 * 1536, generator=gen) * 6).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    native(monkeypatch)
    assert torch.equal(silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


def planted_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, and rows built to catch a wrong argmax: ties (the first must win, also across the
    kernel's 1,024-value chunks), NaNs (torch: the first NaN wins, even after a larger number), all -inf,
    +0 against -0, +inf."""
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(12, vocab, generator=gen)
    last = vocab - 1
    rows[1, [last // 3, last]] = 50.0  # a tie: the first
    rows[2, [min(1023, last), min(1024, last)]] = 60.0  # a tie on a chunk boundary
    rows[3, last // 2] = float("nan")
    rows[3, last] = 70.0  # a larger number after the NaN
    rows[4, [last // 4, last]] = float("nan")  # two NaNs: the first
    rows[5] = float("-inf")
    rows[6] = -1.0
    rows[6, last // 5] = -0.0
    rows[6, last] = 0.0  # equal to -0.0: the first of the two
    rows[7, last] = float("inf")
    rows[8, 0] = float("nan")
    rows[9, last] = float("nan")
    rows[10, 0] = 80.0
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 7, 1023, 1024, 1025, 5000, 49152])
def test_argmax_rows_picks_what_torch_argmax_picks(
    dtype: torch.dtype, vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = planted_rows(vocab, dtype)
    expect = rows.argmax(dim=-1)
    native(monkeypatch)
    assert torch.equal(argmax_rows(rows), expect)
    wide = torch.zeros(12, vocab + 40, dtype=dtype)
    wide[:, 3 : 3 + vocab] = rows
    assert torch.equal(argmax_rows(wide[:, 3 : 3 + vocab]), expect)  # rows apart in memory
    assert torch.equal(argmax_rows(rows[5:9]), expect[5:9])
    assert argmax_rows(rows[:0]).shape == (0,)


def test_argmax_rows_refuses_a_mismatched_output() -> None:
    from kernels import native

    assert native.available()
    logits = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.loragate_cpu.argmax_rows(torch.empty(2, dtype=torch.int64), logits)
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.loragate_cpu.argmax_rows(torch.empty(3, dtype=torch.int32), logits)


def test_the_torch_fallbacks_compute_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    gen = torch.Generator().manual_seed(4)
    h, delta, w = (
        torch.randn(5, 32, generator=gen),
        torch.randn(5, 32, generator=gen),
        torch.rand(32, generator=gen),
    )
    new_h, x = add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(new_h, h + delta) and torch.equal(x, rms_norm_torch(h + delta, w, 1e-6))
    gate_up = torch.randn(5, 64, generator=gen)
    assert torch.equal(silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:])
    rows = planted_rows(300, torch.float32)
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_write_kv_is_rope_then_write_kv_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One native pass over the fused qkv rows: q and k rotated in place, k and v in their cache slots, every
    other slot untouched; the same bits as `rope_` then `write_kv` on torch's ops."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, rows = 6, 2, 64, 11
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.arange(40.0)[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    positions = torch.randint(0, 40, (rows,), generator=gen)
    slots = torch.randperm(5 * 8, generator=gen)[:rows]
    caches = [torch.randn(5, 8, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    results = {}
    for backend in ("native", "torch"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        x, k_cache, v_cache = qkv.clone(), caches[0].clone(), caches[1].clone()
        rope_write_kv(x, heads, kv_heads, dim, cos, sin, positions, k_cache, v_cache, slots)
        results[backend] = (x, k_cache, v_cache)
    for got, want in zip(results["native"], results["torch"], strict=True):
        assert torch.equal(got, want)
    x, k_cache, v_cache = results["native"]
    assert torch.equal(x[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])  # v as it was
    assert torch.equal(v_cache.view(-1, kv_heads * dim)[slots], qkv[:, (heads + kv_heads) * dim :])
    kept = torch.ones(40, dtype=torch.bool)
    kept[slots] = False
    assert torch.equal(k_cache.view(-1, kv_heads * dim)[kept], caches[0].view(-1, kv_heads * dim)[kept])
    monkeypatch.setenv(BACKEND_ENV, "native")
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_write_kv(qkv.clone(), heads, kv_heads, dim, cos, sin, positions, k_cache, v_cache, slots + 40)
    with pytest.raises(RuntimeError, match="outside the tables"):
        rope_write_kv(qkv.clone(), heads, kv_heads, dim, cos, sin, positions + 40, k_cache, v_cache, slots)
