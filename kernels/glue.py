"""The small per-layer ops of the forward (RMSNorm with the residual add, RoPE, SiLU-and-multiply) and the
greedy pick of a step's tokens (argmax over each row of logits): torch ops, or one native CPU kernel each
(`kernels/csrc/glue_cpu.cpp`, see `kernels.native`) where those run.

Both compute what Hugging Face Llama computes, with the same rounding points: the RMS in fp32, the
normalized row rounded to the storage dtype before the weight multiplies it; rotate-half RoPE; SiLU
rounded before it multiplies `up`. On a CPU the step's rows are few (decode: one per sequence) and each
torch op costs more in dispatch and temporaries than in arithmetic, which the native kernels avoid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import use_native


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h + delta, rms_norm(h + delta))` (`delta` None: nothing added). The native path adds in place
    into `h` (which must then be the caller's own buffer, as the residual stream is)."""
    if use_native(h) and h.stride(-1) == 1 and (delta is None or delta.stride(-1) == 1):
        out = torch.empty_like(h)
        torch.ops.loragate_cpu.rms_norm(out, h, delta, weight, eps)
        return h, out
    if delta is not None:
        h = h + delta
    return h, rms_norm_torch(h, weight, eps)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] (the tables' rows at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_(
    x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate the first `heads * head_dim` columns of `x` `[T, >= heads * head_dim]` in place: each head
    by the RoPE tables `cos`, `sin` `[max_positions, head_dim]` at the token's position `[T]` (int64)."""
    if use_native(x) and x.stride(-1) == 1:
        torch.ops.loragate_cpu.rope(x, cos, sin, positions, heads, head_dim)
        return
    t = x.shape[0]
    part = x[:, : heads * head_dim].view(t, heads, head_dim)
    part.copy_(rope_torch(part, cos[positions][:, None, :], sin[positions][:, None, :]))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` `[T, 2n]` = gate `[T, :n]` beside up `[T, n:]`."""
    n = gate_up.shape[-1] // 2
    if use_native(gate_up) and gate_up.stride(-1) == 1:
        out = gate_up.new_empty(gate_up.shape[0], n)
        torch.ops.loragate_cpu.silu_mul(out, gate_up)
        return out
    gate, up = gate_up.split(n, dim=-1)
    return F.silu(gate) * up


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for `logits` `[N, V]` in any float dtype: `[N]` int64, the first index of a
    row's largest value, or of its first NaN (torch's rule). On a CPU, torch's argmax reads a row one
    element at a time (7 ms for 128 rows of a 49k vocabulary, a tenth of a decode step); the native kernel
    reads it at memory speed and needs no fp32 copy of 16-bit logits."""
    if use_native(logits) and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        torch.ops.loragate_cpu.argmax_rows(out, logits)
        return out
    return logits.argmax(dim=-1)
