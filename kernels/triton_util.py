# mypy: allow-untyped-defs
# (@triton.jit kernels take untyped pointers and scalars; their wrappers below are typed.)
"""Shared pieces of the Triton kernels: the matrix-multiply helper, the launch-time checks and the
constants and cache strides both paged-attention kernels use.

Two interpreter traps shape this module. Under `TRITON_INTERPRET=1` a bf16 `tl.dot` returns garbage, so
kernels upcast its operands to fp32 there (and only there: a GPU multiplies bf16 natively). The
interpreter also accepts `tl.dot` tiles smaller than 16, which a GPU rejects at compile time, so every
wrapper checks its tiles with `require_dot_tiles` before launching.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import triton_interpreting

MIN_DOT_TILE = 16
# Hopper (H100 SXM) streaming multiprocessors: the split heuristics aim for about two programs per SM.
HOPPER_SMS = 132
# Attention softmax runs in the log2 domain (`exp2`): scores are scaled by `scale * LOG2E`.
LOG2E = 1.4426950408889634
# The window the attention kernels get when there is none: larger than any context.
NO_WINDOW = 2**31 - 1


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """`acc + a @ b` with fp32 accumulation; fp32 operands use exact (`ieee`) products, not TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 `x` rounded to `DTYPE`. Under the interpreter (`UPCAST`, bf16 operands) a cast to bf16
    truncates, so there the rounding to nearest-even is done on the bits and the value stays fp32, which
    is what the upcast `mma` takes."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """`(UPCAST, PRECISION)` for `mma` on operands of `dtype`."""
    upcast = triton_interpreting() and dtype == torch.bfloat16
    # The precision only applies to fp32 operands; 16-bit ones multiply natively whatever it says.
    return upcast, "ieee" if dtype == torch.float32 else "tf32"


def require_dot_tiles(**tiles: int) -> None:
    small = {name: size for name, size in tiles.items() if size < MIN_DOT_TILE}
    if small:
        raise ValueError(f"tl.dot tiles must be at least {MIN_DOT_TILE} wide on a GPU; got {small}")


def sgmv_block_m(num_tokens: int, num_segments: int) -> int:
    """The SGMV kernels' row tile: long segments (prefill) reuse each weight tile over more rows; decode
    segments are a few rows."""
    mean_len = num_tokens // max(num_segments, 1)
    return 64 if mean_len >= 128 else 32 if mean_len >= 32 else 16


def sgmv_split_k(busy_programs: int, k_tiles: int) -> int:
    """How many ways the SGMV shrink splits its reduction: about two programs per SM in all, at most one
    K tile per split and 16 splits."""
    want = max(1, 2 * HOPPER_SMS // max(busy_programs, 1))
    return max(1, min(want, k_tiles, 16))


def pow2_tile(n: int, lo: int = MIN_DOT_TILE, hi: int = 128) -> int:
    """The power-of-two tile covering `n`, clamped to `[lo, hi]`."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def require_unit_last_stride(**tensors: torch.Tensor) -> None:
    strided = [name for name, t in tensors.items() if t.stride(-1) != 1]
    if strided:
        raise ValueError(f"the Triton kernels need a unit stride in the last dimension: {strided}")


def kv_cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """Block, token and KV-head strides of the `[NB, BS, KVH, D]` caches, K's three then V's."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])
