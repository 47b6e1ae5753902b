"""The LM head's native CPU kernel (`kernels.lm_head`): logits against float64, and the fused greedy pick
against `argmax_rows` of the logits (ties, NaN, bf16 rounding, ragged shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import PackedLMHead, lm_head_argmax, lm_head_logits, pack_lm_head
from kernels.backend import BACKEND_ENV
from kernels.glue import argmax_rows
from kernels.linear import BF16_LINEAR_ENV, is_packed
from kernels.linear_amx import AMXWeight
from kernels.lm_head import PANEL
from kernels.sgmv_native import amx_ready

# Relative to the sum of absolute products (fp32 sums in another order; bf16 rounds each logit once).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def head_and_rows(
    vocab: int, hidden: int, rows: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.05).to(dtype)
    return w, torch.randn(rows, hidden, generator=gen).to(dtype)


@pytest.fixture(autouse=True)
def native_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    monkeypatch.setenv(BF16_LINEAR_ENV, "widen")  # bf16 heads packed (as on a CPU without bf16 units)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("vocab", "hidden"), [(PANEL, 16), (1001, 64), (32000, 256), (5, 576)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 130])
def test_logits_match_float64_and_the_pick_is_their_argmax(
    vocab: int, hidden: int, rows: int, dtype: torch.dtype
) -> None:
    w, x = head_and_rows(vocab, hidden, rows, dtype, seed=vocab + hidden + rows)
    head = pack_lm_head(w)
    assert isinstance(head, PackedLMHead) and head.panels.dtype == torch.float32
    assert pack_lm_head(head) is head  # packing twice packs once
    logits = lm_head_logits(x, head)
    assert logits.dtype == dtype and logits.shape == (rows, vocab)
    exact = F.linear(x.double(), w.double())
    scale = F.linear(x.double().abs(), w.double().abs())
    assert float(((logits.double() - exact).abs() / scale).max()) < TOLERANCE[dtype]
    assert torch.equal(lm_head_argmax(x, head), argmax_rows(logits))


def test_ties_go_to_the_first_index_and_nan_wins() -> None:
    w, x = head_and_rows(300, 32, 4, torch.float32, seed=3)
    x = x.abs()
    w[17] = w[17].abs() * 50  # every row's largest logit, by far...
    w[250] = w[17]  # ... tied exactly with a column of another panel: the first index wins
    head = pack_lm_head(w)
    assert lm_head_argmax(x, head).tolist() == [17] * 4
    w[123, 0] = float("nan")  # a NaN column beats every number
    x[1, 5] = float("nan")  # and row 1 is NaN throughout: its first column wins
    head = pack_lm_head(w)
    picks = lm_head_argmax(x, head)
    assert picks.tolist() == [123, 0, 123, 123]
    assert torch.equal(picks, lm_head_logits(x, head).argmax(dim=-1))


def test_bf16_picks_compare_logits_as_bf16_rounds_them() -> None:
    # Two columns whose fp32 logits differ by less than bf16 can tell apart: rounded, they tie, and the
    # first wins, as argmax over bf16 logits picks it; compared in fp32, the second would have won.
    hidden = 64
    x = torch.ones(1, hidden, dtype=torch.bfloat16)
    w = torch.zeros(200, hidden, dtype=torch.bfloat16)
    w[10, 0] = 1.0
    w[150, 0] = 1.0
    w[150, 1] = 2.0**-12  # logit 1 + 2^-12: above 1 in fp32, 1 in bf16
    head = pack_lm_head(w)
    assert float(F.linear(x.float(), w.float())[0, 150]) > 1.0
    assert int(lm_head_argmax(x, head)[0]) == 10
    assert int(argmax_rows(lm_head_logits(x, head))[0]) == 10


def test_a_row_gets_the_same_bits_whatever_batch_it_is_in() -> None:
    w, x = head_and_rows(2000, 256, 21, torch.float32, seed=5)
    head = pack_lm_head(w)
    logits = lm_head_logits(x, head)
    for i in (0, 8, 20):
        assert torch.equal(lm_head_logits(x[i : i + 1], head)[0], logits[i])


def test_no_rows_and_the_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    w, x = head_and_rows(500, 64, 3, torch.float32, seed=6)
    head = pack_lm_head(w)
    assert lm_head_argmax(x[:0], head).shape == (0,)
    assert lm_head_logits(x[:0], head).shape == (0, 500)
    monkeypatch.setenv(BACKEND_ENV, "torch")
    plain = pack_lm_head(w)  # the torch backend keeps the weight as `kernels.linear` would
    assert not isinstance(plain, PackedLMHead) and not is_packed(plain)
    exact = F.linear(x.double(), w.double())
    assert torch.equal(lm_head_argmax(x, plain), exact.argmax(dim=-1))


@pytest.mark.skipif(not amx_ready(), reason="no AMX tiles on this CPU (or not granted)")
@pytest.mark.parametrize("rows", [1, 9, 130])
def test_a_bf16_head_on_amx_picks_in_the_amx_kernel(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    monkeypatch.setenv(BF16_LINEAR_ENV, "auto")  # bf16 linears on the AMX kernel
    w, x = head_and_rows(32000, 576, rows, torch.bfloat16, seed=rows)
    head = pack_lm_head(w)
    assert isinstance(head, AMXWeight)
    logits = lm_head_logits(x, head)
    assert torch.equal(lm_head_argmax(x, head), argmax_rows(logits))
    exact = F.linear(x.double(), w.double())
    scale = F.linear(x.double().abs(), w.double().abs())
    assert float(((logits.double() - exact).abs() / scale).max()) < TOLERANCE[torch.bfloat16]
