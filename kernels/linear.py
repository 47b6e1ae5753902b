"""Dense linear layers (`y = x Wᵀ + b`) with the weight in the layout the device's fastest matmul wants.

On a CPU with oneDNN (every x86 PyTorch wheel has it), `pack_linear_weight` reorders a float32 or
bfloat16 weight once, at load time, into oneDNN's blocked layout, and `linear` runs oneDNN's matmul on it.
A plain `F.linear` goes to MKL's sgemm, which repacks the weight on every call and, on AMD CPUs, takes
its AVX2 path: at decode batch sizes (8–128 rows) the packed oneDNN matmul is 1.7–3× faster in float32
and 1.1–2× in bfloat16 on this project's machines (the `linear` cases of
`python -m loadtest.bench_kernels --backend native`). The results
equal `F.linear`'s up to float rounding (the sum order differs; no reduced precision is used: oneDNN's
fp32 math mode stays strict).

A bfloat16 weight on a CPU without bf16 units (no AVX512-BF16, no AMX) is **widened**: packed as the
float32 it holds exactly, and `linear` multiplies the bf16 rows in float32 and rounds the result to
bf16 once. That is what a bf16 matmul computes (bf16 × bf16 products are exact in fp32, summed in fp32,
rounded at the end); oneDNN's own bf16 matmul there emulates the bf16 units and runs 2–3.7× slower than
the fp32 one (`python -m loadtest.bench_kernels --backend native`, `linear` cases; 30 SmolLM2 layers at
128 rows: 450 ms against 132 ms widened, Ice Lake). The cost is the weights' memory, twice bf16's.

A bfloat16 weight on a CPU with AMX tiles (Intel Sapphire Rapids and later) goes to the native AMX kernel
(`kernels.linear_amx`): at decode batch sizes a matmul is as much its weight's stream from memory as
arithmetic, and that kernel overlaps the two where oneDNN's does one after the other (30 SmolLM2 layers'
distinct weights at 128 rows: 17-18 ms against oneDNN's 22; docs/BENCHMARKS.md). A fused gate/up weight
packed `gated` there also gives `linear_silu_mul`: the MLP's activation computed as each panel's sums are
rounded, bit for bit `silu_mul(linear(x, w))`, without the `[rows, 2 * inter]` round trip through memory.

`LORAGATE_CPU_BF16_LINEAR` chooses: `auto` (the AMX kernel where AMX runs, else widen without bf16 units,
else oneDNN's bf16 matmul), `widen`, `native` (oneDNN's bf16 matmul) or `amx` (the AMX kernel where AMX
runs, else as `native`).

Anywhere else (CUDA, float16, the `torch` backend) the weight stays as it is and `linear` is `F.linear`.
Which one runs is decided by the weight's layout and dtype, so a packed model and a plain one can
coexist in one process.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.backend import BACKEND_ENV, BACKENDS, backend_choice
from kernels.linear_amx import AMXWeight, gates, linear_amx, linear_amx_silu_mul, pack_amx
from kernels.sgmv_native import amx_ready

BF16_LINEAR_ENV = "LORAGATE_CPU_BF16_LINEAR"
LinearWeight = torch.Tensor | AMXWeight  # what `pack_linear_weight` gives
BF16_LINEAR_MODES = ("auto", "widen", "native", "amx")


def bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles)."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def _bf16_mode() -> str:
    mode = os.environ.get(BF16_LINEAR_ENV, "auto")
    if mode not in BF16_LINEAR_MODES:
        raise ValueError(f"{BF16_LINEAR_ENV}={mode!r}; expected one of {BF16_LINEAR_MODES}")
    return mode


def widens(weight: torch.Tensor) -> bool:
    """True when `pack_linear_weight` packs the bfloat16 `weight` as float32 (see the module docstring)."""
    mode = _bf16_mode()
    if weight.dtype != torch.bfloat16 or not _onednn_here(weight):
        return False
    return mode == "widen" or (mode == "auto" and not bf16_units())


def _onednn_here(weight: torch.Tensor) -> bool:
    """A 2-D CPU weight, oneDNN in this torch, and the backend `auto` or `native`."""
    choice = backend_choice()
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r}; expected one of {BACKENDS}")
    if choice not in ("auto", "native") or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    return bool(torch.backends.mkldnn.is_available())


def uses_amx(weight: torch.Tensor) -> bool:
    """True when `pack_linear_weight` packs the bfloat16 `weight` for the native AMX kernel
    (`kernels.linear_amx`): mode `auto` or `amx`, on a CPU where AMX runs."""
    if weight.dtype != torch.bfloat16 or _bf16_mode() not in ("auto", "amx") or not _onednn_here(weight):
        return False
    return amx_ready()


def onednn_packs(weight: torch.Tensor) -> bool:
    """True when `pack_linear_weight` would pack `weight`, as it is or widened (see the module docstring)."""
    if not _onednn_here(weight):
        return False
    if weight.dtype == torch.float32 or widens(weight):
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weight(weight: LinearWeight, gated: bool = False) -> LinearWeight:
    """The weight in the layout `linear` runs fastest on this device (a new tensor), or `weight` itself.

    Semantics: `linear(x, pack_linear_weight(w), b) == F.linear(x, w, b)` up to float rounding; a weight
    already packed is returned as it is.

    Args:
        weight: the layer's weight, as `nn.Linear` holds it.
            Shape: [out_features, in_features]
        gated: `weight` is a fused gate/up projection `[gate; up]`: packed so that `linear_silu_mul` can
            run on it where the AMX kernel does (`fuses_silu`).
    """
    if isinstance(weight, AMXWeight) or is_packed(weight):
        return weight
    if uses_amx(weight):
        return pack_amx(weight, gated=gated and gates(weight))
    if not onednn_packs(weight):
        return weight
    if widens(weight):
        weight = weight.float()
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def is_packed(weight: LinearWeight) -> bool:
    """Whether `weight` is in oneDNN's blocked layout."""
    return isinstance(weight, torch.Tensor) and weight.layout == torch._mkldnn  # type: ignore[attr-defined]


def fuses_silu(weight: LinearWeight) -> bool:
    """Whether `linear_silu_mul` runs on `weight` (a gate/up weight packed gated for the AMX kernel)."""
    return isinstance(weight, AMXWeight) and weight.gated


def linear_silu_mul(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(g) * u` of `[g, u] = x Wᵀ + b` (a new tensor), on a weight `fuses_silu` accepts.

    Semantics: `kernels.glue.silu_mul(linear(x, weight, bias))`, bit for bit.

    Args:
        x: the input rows.
            Shape: [num_rows, in_features]
        weight: from `pack_linear_weight(w, gated=True)`.
            Shape: [2 * intermediate, in_features]
        bias: the bias, or None.
            Shape: [2 * intermediate]
    """
    if not isinstance(weight, AMXWeight):
        raise ValueError("linear_silu_mul: a weight packed gated for the AMX kernel (fuses_silu)")
    return linear_amx_silu_mul(x, weight, bias)


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
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
    if isinstance(weight, AMXWeight):
        return linear_amx(x, weight, bias)
    if not is_packed(weight):
        return F.linear(x, weight, bias)
    if weight.dtype == torch.float32 and x.dtype == torch.bfloat16:  # widened: fp32 math, one rounding
        wide = None if bias is None else bias.float()
        y = torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), weight, wide, "none", [], "")
        return y.to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
