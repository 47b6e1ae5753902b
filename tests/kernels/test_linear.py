"""Dense linears on packed weights (`kernels.linear`) against a float64 reference, and when they pack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear, pack_linear_weight, silu_mul
from kernels.backend import BACKEND_ENV
from kernels.linear import (
    BF16_LINEAR_ENV,
    bf16_units,
    fuses_silu,
    is_packed,
    linear_silu_mul,
    onednn_packs,
    uses_amx,
    widens,
)
from kernels.linear_amx import AMXWeight
from kernels.sgmv_native import amx_ready

# Relative to the reference's magnitude (|x|·|W| summed): fp32 sums in another order; bf16 rounds the
# output once (8 bits of mantissa) after an fp32 accumulation.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result and its scale (the sum of absolute products per output)."""
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    return y, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [0, 1, 7, 48, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(
    dtype: torch.dtype, rows: int, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BACKEND_ENV, "auto")
    gen = torch.Generator().manual_seed(rows * 2 + bias)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(dtype)
    b = torch.randn(960, generator=gen).to(dtype) if bias else None
    packed = pack_linear_weight(w)
    assert isinstance(packed, AMXWeight) == uses_amx(w)
    assert is_packed(packed) == (onednn_packs(w) and not uses_amx(w))
    assert pack_linear_weight(packed) is packed  # packing twice packs once
    if dtype == torch.float32:
        assert is_packed(packed), "every x86 torch wheel has oneDNN: fp32 weights are packed on a CPU"
    y = linear(x, packed, b)
    assert y.shape == (rows, 960) and y.dtype == dtype
    expect, scale = reference(x, w, b)
    assert ((y.double() - expect).abs() <= TOLERANCE[dtype] * scale + 1e-6).all()
    # The same matmul as the plain weight's, up to rounding in the sum order.
    plain = F.linear(x, w, b)
    assert ((y.double() - plain.double()).abs() <= 2 * TOLERANCE[dtype] * scale + 1e-6).all()


def test_a_strided_input_is_read_as_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "auto")
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(16, 1152, generator=gen)
    x = wide[:, ::2]  # not contiguous
    w = torch.randn(64, 576, generator=gen)
    expect, scale = reference(x, w, None)
    assert ((linear(x, pack_linear_weight(w)).double() - expect).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_other_backends_keep_the_weight_plain(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `torch` backend is the reference path: plain `F.linear`, the weight untouched."""
    monkeypatch.setenv(BACKEND_ENV, backend)
    w = torch.randn(8, 4)
    assert pack_linear_weight(w) is w
    x = torch.randn(3, 4)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_float16_and_non_cpu_weights_stay_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "auto")
    half = torch.randn(8, 4, dtype=torch.float16)
    assert pack_linear_weight(half) is half
    meta = torch.empty(8, 4, device="meta")
    assert pack_linear_weight(meta) is meta


def test_an_unknown_backend_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "cublas")
    with pytest.raises(ValueError, match="cublas"):
        pack_linear_weight(torch.randn(2, 2))


@pytest.mark.parametrize("mode", ["widen", "native", "amx"])
@pytest.mark.parametrize("rows", [1, 48, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_widened_or_native_compute_a_bf16_matmul(
    mode: str, rows: int, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Widened, a bf16 weight is packed as float32 and the result is the bf16 matmul's (fp32 sums, one
    rounding): within bf16's rounding of the float64 reference and of the oneDNN bf16 matmul's. So is the
    AMX kernel's, where AMX runs (elsewhere `amx` packs as `native` does)."""
    monkeypatch.setenv(BACKEND_ENV, "auto")
    monkeypatch.setenv(BF16_LINEAR_ENV, mode)
    gen = torch.Generator().manual_seed(rows * 2 + bias + 100)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    b = torch.randn(960, generator=gen).bfloat16() if bias else None
    packed = pack_linear_weight(w)
    assert widens(w) == (mode == "widen")
    if mode == "widen":
        assert is_packed(packed) and packed.dtype == torch.float32
    assert isinstance(packed, AMXWeight) == (mode == "amx" and amx_ready())
    y = linear(x, packed, b)
    assert y.shape == (rows, 960) and y.dtype == torch.bfloat16
    expect, scale = reference(x, w, b)
    # One bf16 rounding of an fp32 sum: half an ulp of the result plus the fp32 sum's own error.
    assert ((y.double() - expect).abs() <= expect.abs() * 2.0**-8 + 1e-5 * scale + 1e-6).all()
    monkeypatch.setenv(BF16_LINEAR_ENV, "native")
    other = linear(x, pack_linear_weight(w), b)
    assert ((y.double() - other.double()).abs() <= 2 * TOLERANCE[torch.bfloat16] * scale + 1e-6).all()


def test_bf16_widening_follows_the_cpu_and_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "auto")
    w = torch.randn(32, 16).bfloat16()
    monkeypatch.delenv(BF16_LINEAR_ENV, raising=False)
    assert widens(w) == (not bf16_units())
    assert uses_amx(w) == amx_ready()
    monkeypatch.setenv(BF16_LINEAR_ENV, "widen")
    assert widens(w) and not widens(w.float()) and not widens(w.half())
    assert not uses_amx(w)
    monkeypatch.setenv(BACKEND_ENV, "torch")  # the reference path never packs
    assert not widens(w) and pack_linear_weight(w) is w
    monkeypatch.setenv(BACKEND_ENV, "auto")
    monkeypatch.setenv(BF16_LINEAR_ENV, "always")
    with pytest.raises(ValueError, match=BF16_LINEAR_ENV):
        pack_linear_weight(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gate_up_weight_fuses_its_silu_only_on_the_amx_kernel(dtype: torch.dtype) -> None:
    """`gated` packs a fused gate/up weight for `linear_silu_mul` where the AMX kernel runs it; elsewhere the
    weight packs as any other and `linear_silu_mul` refuses it (the caller runs `linear` then `silu_mul`)."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(128, 64, generator=gen) * 0.1).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    packed = pack_linear_weight(w, gated=True)
    assert fuses_silu(packed) == uses_amx(w)
    assert not fuses_silu(pack_linear_weight(w))
    assert not fuses_silu(pack_linear_weight(w[:112], gated=True))  # halves of 56: no whole panels
    if fuses_silu(packed):
        assert torch.equal(linear_silu_mul(x, packed), silu_mul(linear(x, packed)))
        assert torch.equal(linear(x, packed), linear(x, pack_linear_weight(w)))
    else:
        with pytest.raises(ValueError, match="gated"):
            linear_silu_mul(x, packed)
