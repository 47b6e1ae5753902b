"""Dense linear layers (`y = x Wᵀ + b`) with the weight in the layout the device's fastest matmul wants.

On a CPU with oneDNN (every x86 PyTorch wheel has it), `pack_linear_weight` reorders a float32 or
bfloat16 weight once, at load time, into oneDNN's blocked layout, and `linear` runs oneDNN's matmul on it.
A plain `F.linear` goes to MKL's sgemm, which repacks the weight on every call and, on AMD CPUs, takes
its AVX2 path: at decode batch sizes (8–128 rows) the packed oneDNN matmul is 1.7–3× faster in float32
and 1.1–2× in bfloat16 on this project's machines (the `linear` cases of
`python -m loadtest.bench_kernels --backend native`). The results
equal `F.linear`'s up to float rounding (the sum order differs; no reduced precision is used: oneDNN's
fp32 math mode stays strict).

Anywhere else (CUDA, float16, the `torch` backend, a CPU without bf16 support for a bf16 weight) the
weight stays as it is and `linear` is `F.linear`. Which one runs is decided by the weight's layout, so a
packed model and a plain one can coexist in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import BACKEND_ENV, BACKENDS, backend_choice


def onednn_packs(weight: torch.Tensor) -> bool:
    """True when `pack_linear_weight` would pack `weight` (see the module docstring)."""
    choice = backend_choice()
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r}; expected one of {BACKENDS}")
    if choice not in ("auto", "native") or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the layout `linear` runs fastest on this device (a new tensor), or `weight` itself.

    Semantics: `linear(x, pack_linear_weight(w), b) == F.linear(x, w, b)` up to float rounding.

    Args:
        weight: the layer's weight, as `nn.Linear` holds it.
            Shape: [out_features, in_features]
    """
    if not onednn_packs(weight):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def is_packed(weight: torch.Tensor) -> bool:
    return weight.layout == torch._mkldnn  # type: ignore[attr-defined]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`y = x Wᵀ + b` (a new tensor).

    Semantics: `F.linear`, on a weight from `pack_linear_weight` (packed or not).

    Args:
        x: the input rows.
            Shape: [num_rows, in_features]
        weight: from `pack_linear_weight`.
            Shape: [out_features, in_features]
        bias: the bias, or None.
            Shape: [out_features]
    """
    if not is_packed(weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
