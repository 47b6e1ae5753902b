"""The native AMX bf16 linear (`kernels.linear_amx`): its packing (pure torch, everywhere) and, where AMX
runs, its results against a float64 reference on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.glue import argmax_rows, silu_mul
from kernels.linear_amx import (
    KBLOCK,
    PANEL,
    gates,
    linear_amx,
    linear_amx_argmax,
    linear_amx_silu_mul,
    pack_amx,
)
from kernels.sgmv_native import amx_ready

needs_amx = pytest.mark.skipif(not amx_ready(), reason="no AMX tiles on this CPU (or not granted)")


def test_packing_puts_each_weight_where_the_tiles_read_it() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 70, 45  # neither a multiple of the panel nor of the tile's k
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = pack_amx(w)
    assert packed.shape == (n, k) and packed.dtype == torch.bfloat16
    assert packed.panels.shape == (3, 2, 1024) and packed.panels.is_contiguous()
    flat = packed.panels
    places = [(0, 0, 0, 0, 0, 0), (1, 1, 1, 6, 3, 0), (2, 0, 0, 15, 5, 1), (0, 1, 1, 2, 15, 1)]
    for p, kb, h, i, c, e in places:
        row, col = p * PANEL + h * 16 + c, kb * KBLOCK + 2 * i + e
        want = w[row, col] if row < n and col < k else torch.tensor(0.0).bfloat16()
        assert flat[p, kb, h * 512 + i * 32 + c * 2 + e] == want
    # Every weight once, zeros elsewhere.
    assert flat.float().abs().sum() == pytest.approx(w.float().abs().sum().item(), rel=1e-6)


def test_a_gated_weight_pairs_each_panel_s_gate_and_up_columns() -> None:
    """Packed gated, panel p holds the gate's columns 16p..16p+15 (first tile) and the up projection's same
    16 (second tile)."""
    gen = torch.Generator().manual_seed(1)
    inter, k = 48, 40
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    packed = pack_amx(w, gated=True)
    assert packed.gated and packed.shape == (2 * inter, k) and packed.panels.shape == (3, 2, 1024)
    places = [(0, 0, 0, 0, 0, 0), (1, 1, 1, 3, 7, 1), (2, 0, 1, 15, 15, 0), (2, 1, 0, 2, 9, 1)]
    for p, kb, h, i, c, e in places:
        row, col = h * inter + p * 16 + c, kb * KBLOCK + 2 * i + e
        want = w[row, col] if col < k else torch.tensor(0.0).bfloat16()
        assert packed.panels[p, kb, h * 512 + i * 32 + c * 2 + e] == want
    assert not pack_amx(w).gated
    assert gates(w) and not gates(w[:80])
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_amx(w[:80], gated=True)


def test_only_2d_bf16_weights_pack() -> None:
    with pytest.raises(ValueError, match="bf16"):
        pack_amx(torch.randn(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        pack_amx(torch.randn(2, 4, 4).bfloat16())


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    return y, scale


@needs_amx
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (0, 64, 64),
        (1, 960, 576),
        (15, 40, 64),
        (16, 96, 576),
        (17, 64, 576),
        (31, 33, 70),
        (32, 576, 1536),
        (47, 64, 96),
        (130, 960, 576),
        (260, 2080, 1536),  # a prefill's panels in several groups (kernels/csrc/linear_amx.cpp)
        (300, 64, 32),
        (513, 96, 64),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_within_one_bf16_rounding(rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k + bias)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    y = linear_amx(x, pack_amx(w), b)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    expect, scale = reference(x, w, b)
    # fp32 sums, one rounding to bf16: half an ulp of the result plus the fp32 sum's own error.
    assert ((y.double() - expect).abs() <= expect.abs() * 2.0**-8 + 1e-5 * scale + 1e-6).all()


@needs_amx
def test_a_row_does_not_depend_on_the_rows_beside_it() -> None:
    """Each output sums over k in one order whatever the batch: a row alone, in a tile, in the padded tail
    or past a pass of rows gives the same bits."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, 576, generator=gen).bfloat16()
    w = pack_amx((torch.randn(200, 576, generator=gen) * 0.05).bfloat16())
    b = torch.randn(200, generator=gen).bfloat16()
    full = linear_amx(x, w, b)
    for lo, hi in [(0, 1), (5, 6), (17, 40), (256, 300), (299, 300), (3, 260)]:
        assert torch.equal(linear_amx(x[lo:hi], w, b), full[lo:hi])


@needs_amx
def test_strided_rows_and_columns_are_read_as_their_values() -> None:
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(20, 1200, generator=gen).bfloat16()
    w = (torch.randn(64, 576, generator=gen) * 0.05).bfloat16()
    packed = pack_amx(w)
    rows = wide[:, 7:583]  # a row stride of 1200, unaligned start
    assert torch.equal(linear_amx(rows, packed), linear_amx(rows.contiguous(), packed))
    cols = wide[:, ::2][:, :576]  # not unit stride along k
    assert torch.equal(linear_amx(cols, packed), linear_amx(cols.contiguous(), packed))


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 15, 17, 64, 130, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_gated_weight_gives_the_plain_result_and_its_silu_mul_bit_for_bit(rows: int, bias: bool) -> None:
    """The same matmul in the weight's own column order, and silu(gate) * up computed as each panel is
    rounded: bit for bit `silu_mul` after the plain linear, decode- and prefill-sized calls alike."""
    gen = torch.Generator().manual_seed(rows + 100 * bias)
    inter, k = 1536, 576
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(2 * inter, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16() if bias else None
    plain = linear_amx(x, pack_amx(w), b)
    gated = pack_amx(w, gated=True)
    assert torch.equal(linear_amx(x, gated, b), plain)
    act = linear_amx_silu_mul(x, gated, b)
    assert act.shape == (rows, inter) and act.dtype == torch.bfloat16
    assert torch.equal(act, silu_mul(plain))
    # and SiLU against float64, from the rounded halves: within two bf16 roundings
    g, u = plain.double().split(inter, dim=-1)
    expect = g * torch.sigmoid(g) * u
    assert ((act.double() - expect).abs() <= expect.abs() * 2.0**-7 + 1e-6).all()


@needs_amx
def test_silu_mul_wants_a_gated_weight() -> None:
    w = pack_amx(torch.randn(64, 32).bfloat16())
    with pytest.raises(ValueError, match="gated"):
        linear_amx_silu_mul(torch.randn(2, 32).bfloat16(), w)


ARGMAX_SHAPES = [(0, 64), (1, 49152), (17, 32000), (64, 1001), (130, 77), (300, 4096)]


@needs_amx
@pytest.mark.parametrize(("rows", "n"), ARGMAX_SHAPES)
def test_the_argmax_is_argmax_rows_of_the_rounded_results(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = pack_amx((torch.randn(n, 576, generator=gen) * 0.05).bfloat16())
    picks = linear_amx_argmax(x, w)
    assert picks.dtype == torch.int64 and picks.shape == (rows,)
    assert torch.equal(picks, argmax_rows(linear_amx(x, w)))


@needs_amx
def test_the_argmax_takes_the_first_of_ties_and_a_nan_across_the_threads_panels() -> None:
    """Columns 40 and 9,000 (another thread's panels on two threads) tie; a later NaN beats both, and a
    row whose every value rounds equal picks column 0."""
    n, k = 10_000, 64
    w = torch.zeros(n, k).bfloat16()
    w[40, 0] = w[9_000, 0] = 1.0
    w[9_500, 1] = 2.0**-12  # 1 + 2^-12 with the first: equal to 1 once rounded to bf16
    w[9_500, 0] = 1.0
    x = torch.zeros(3, k).bfloat16()
    x[0, 0] = x[0, 1] = 1.0
    x[1, 0] = 1.0
    assert linear_amx_argmax(x, pack_amx(w)).tolist() == [40, 40, 0]
    w[7_000, 2] = float("nan")
    x[:, 2] = 1.0
    picks = linear_amx_argmax(x, pack_amx(w))
    assert picks.tolist() == [7_000] * 3
    assert torch.equal(picks, argmax_rows(linear_amx(x, pack_amx(w))))
    with pytest.raises(ValueError, match="gated"):
        linear_amx_argmax(x, pack_amx(w[:9_984], gated=True))
