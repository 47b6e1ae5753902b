"""The Triton `sgmv_group` (all projections of a fused output in one shrink and one expand launch) against
the float64 reference of shrink-then-expand per projection: on the GPU, or interpreted on CPU tensors.

As in test_sgmv_group.py, weights past each slot's rank are NaN and everything outside the adapted slices
must come back bit-exact. Hidden sizes 40 and 80 cover the plain and the split-K (atomic) shrink.
"""

from __future__ import annotations

import pytest
import torch

from kernels import sgmv_group
from tests.kernels.group_testing import LAYER, group_case, reference, untouched
from tests.kernels.kernel_testing import POPULARITIES, TOLERANCE, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [40, 80], ids=["one-k-tile", "split-k"])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_triton_group_matches_the_reference(
    popularity: str, hidden: int, dtype: torch.dtype, device: str
) -> None:
    slots, x, y0, group = group_case(
        popularity, dtype, len(popularity) + hidden, hidden=hidden, device=device
    )
    y = y0.clone()
    sgmv_group(y, x, group, layer=LAYER)
    assert rel_err(y.cpu(), reference(slots, x, y0, group)) < TOLERANCE[dtype]
    keep = untouched(slots, y0, group)
    assert torch.equal(y[keep], y0[keep])


def test_triton_group_refuses_weights_with_strided_rows(device: str) -> None:
    _, x, y0, group = group_case("uniform", torch.float32, 3, transposed_b=True, device=device)
    with pytest.raises(ValueError, match="unit stride"):
        sgmv_group(y0.clone(), x, group, layer=LAYER)
