"""`loadtest.bench_kernels`' dense-layer case over many layers' weights: it times real matmuls and checks
the result it times against float64."""

from __future__ import annotations

import pytest
import torch

from loadtest.bench_kernels import layers_case, mlp_case


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's packed matmul is the alt")
def test_the_layers_case_times_the_packed_linears_against_onednn() -> None:
    timing = layers_case("linear 2 layers T=16 bf16", rows=16, layers=2, repeats=2)
    assert timing.kernel_ms > 0 and timing.alt_ms > 0 and timing.naive_ms > 0
    assert timing.max_rel_err < 2e-2  # one bf16 rounding of fp32 sums
    summary = timing.summary()
    assert summary["speedup_vs_alt"] == round(timing.alt_ms / timing.kernel_ms, 2)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN packs the plain weights")
def test_the_mlp_case_times_silu_in_the_matmul_against_after_it() -> None:
    timing = mlp_case("gate/up+SiLU 2 layers T=16 bf16", rows=16, layers=2, repeats=2)
    assert timing.kernel_ms > 0 and timing.alt_ms > 0 and timing.naive_ms > 0
    assert timing.max_rel_err < 3e-2  # the halves, SiLU and the product each rounded to bf16
