"""`sgmv_group` (q/k/v or gate/up adapters on one input, in one call) against the float64 reference of
shrink-then-expand per projection, on the torch loop and the native fused kernel (`cpu_backend`).

Weights past each slot's rank are NaN, so a kernel that reads them fails; output columns outside the
projections' slices, rows without an adapter and rows of slots that do not adapt a projection must come
back bit-exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import LoRAGroup, sgmv_expand, sgmv_group, sgmv_shrink
from kernels.backend import BACKEND_ENV
from tests.kernels.group_testing import LAYER, group_case, reference, untouched
from tests.kernels.kernel_testing import POPULARITIES, TOLERANCE, rel_err

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("transposed_b", [False, True], ids=["b-rows", "b-transposed"])
def test_group_matches_shrink_then_expand_per_projection(
    popularity: str, dtype: torch.dtype, transposed_b: bool, cpu_backend: str
) -> None:
    for seed in range(3):
        slots, x, y0, group = group_case(popularity, dtype, seed, transposed_b=transposed_b)
        y = y0.clone()
        sgmv_group(y, x, group, layer=LAYER)
        assert rel_err(y, reference(slots, x, y0, group)) < TOLERANCE[dtype]
        keep = untouched(slots, y0, group)
        assert torch.equal(y[keep], y0[keep])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_group_equals_native_shrink_and_expand_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernel computes the same sums in the same order as the two separate ones."""
    monkeypatch.setenv(BACKEND_ENV, "native")
    _, x, y0, group = group_case("zipf", dtype, 5, transposed_b=True, hidden=96)
    fused, separate = y0.clone(), y0.clone()
    sgmv_group(fused, x, group, layer=LAYER)
    for p in group.projections:
        v = x.new_zeros(x.shape[0], p.a.shape[2])
        sgmv_shrink(v, x, p.a, p.meta, layer=LAYER, scale=p.scale, ranks=p.ranks)
        sgmv_expand(separate, v, p.b, p.meta, layer=LAYER, y_offset=p.y_offset, ranks=p.ranks)
    assert torch.equal(fused, separate)


def test_native_group_refuses_a_projection_outside_y(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "native")
    _, x, y0, group = group_case("uniform", torch.float32, 2)
    last = group.projections[-1]
    bad = LoRAGroup((*group.projections[:-1], replace(last, y_offset=y0.shape[1] - 4)), group.meta)
    with pytest.raises(RuntimeError, match="output slice out of y"):
        sgmv_group(y0.clone(), x, bad, layer=LAYER)
    with pytest.raises(RuntimeError, match="layer out of range"):
        sgmv_group(y0.clone(), x, group, layer=2)
