"""Dense linears on packed weights (`kernels.linear`) against a float64 reference, and when they pack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear, pack_linear_weight
from kernels.backend import BACKEND_ENV
from kernels.linear import is_packed, onednn_packs

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
    assert is_packed(packed) == onednn_packs(w)
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
