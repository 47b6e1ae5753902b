"""bf16 linear layers on AMX tiles, for decode-sized batches: `y = bf16(x Wᵀ + b)` from a weight packed once
into panels of 32 output columns (`kernels/csrc/linear_amx.cpp`).

At the row counts of decode steps a layer's matmul is as much a stream of its weight from memory as
arithmetic. oneDNN's AMX matmul does the two one after the other; the native kernel reads each panel as
one contiguous run while its tiles multiply the one before, prefetching the next (`python -m
loadtest.bench_kernels --backend native`, `linear` cases, and docs/BENCHMARKS.md give the figures).
`kernels.linear` chooses it for bf16 weights where AMX runs (`kernels.sgmv_native.amx_ready`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora_meta import LoRAGroup

PANEL = 32  # output columns a panel
KBLOCK = 32  # values of k a tile row


@dataclass(frozen=True)
class AMXWeight:
    """A bf16 weight `[out_features, in_features]` in the native AMX kernel's panels:
    `panels[p, kb, h * 512 + i * 32 + c * 2 + e] = W[row, kb * 32 + 2 * i + e]`, zero past the weight's rows
    and columns, where `row = p * 32 + h * 16 + c`; or, `gated` (a fused gate/up projection, each half
    `out_features / 2` rows), `row = h * out_features / 2 + p * 16 + c`: a panel holds 16 of the gate's
    columns and the up projection's same 16, so that `linear_amx_silu_mul` can finish each panel alone."""

    panels: torch.Tensor  # [ceil(out / 32), ceil(in / 32), 1024] bf16
    out_features: int
    in_features: int
    gated: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))


def gates(weight: torch.Tensor) -> bool:
    """Whether a fused gate/up weight `[2 * inter, in]` can be packed `gated`: each half whole panels' worth
    of 16 columns."""
    return weight.dim() == 2 and weight.shape[0] % (2 * 16) == 0


def _gated_order(t: torch.Tensor) -> torch.Tensor:
    """`t`'s rows (dim 0) in a gated weight's order: 16 of the gate's, the up projection's same 16, and on."""
    n = t.shape[0]
    return t.reshape(2, n // 32, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def pack_amx(weight: torch.Tensor, gated: bool = False) -> AMXWeight:
    """`weight` `[out, in]` (bf16, any strides) in `AMXWeight`'s panels (a new tensor); `gated` for a fused
    gate/up projection (`gates(weight)` must hold)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_amx: a 2-D bf16 weight, got {weight.dtype} {tuple(weight.shape)}")
    if gated:
        if not gates(weight):
            raise ValueError(f"pack_amx: a gated weight's rows are a multiple of 32, got {weight.shape[0]}")
        weight = _gated_order(weight)
    n, k = weight.shape
    np_, kp = -(-n // PANEL) * PANEL, -(-k // KBLOCK) * KBLOCK
    padded = torch.nn.functional.pad(weight, (0, kp - k, 0, np_ - n))
    # [p, h, c, kb, i, e] -> [p, kb, h, i, c, e]
    tiles = padded.reshape(np_ // PANEL, 2, 16, kp // KBLOCK, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return AMXWeight(tiles.reshape(np_ // PANEL, kp // KBLOCK, 2 * 16 * KBLOCK).contiguous(), n, k, gated)


def linear_amx(x: torch.Tensor, weight: AMXWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`y = x Wᵀ + b` (a new tensor), rounded to bf16 once.

    Semantics: `F.linear(x, W, b)` for the W packed in `weight`, every output a float32 sum over
    `in_features` in order (a row's result never depends on the rows beside it).

    Args:
        x: the input rows, bf16, unit stride along `in_features`.
            Shape: [num_rows, in_features]
        weight: from `pack_amx`.
            Shape: [out_features, in_features]
        bias: the bias (any float dtype), or None.
            Shape: [out_features]
    """
    return _run(x, weight, bias, weight.out_features, 1 if weight.gated else 0)


def linear_amx_silu_mul(x: torch.Tensor, weight: AMXWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(g) * u` of `[g, u] = x Wᵀ + b` (a new tensor), for a weight packed `gated`.

    Semantics: `kernels.glue.silu_mul(linear_amx(x, weight, bias))`, bit for bit: each half rounded to
    bf16, SiLU's float result rounded, the product rounded; without writing or reading `[g, u]`. The
    SiLU runs while the tiles compute the next block.

    Args:
        x: the input rows, bf16, unit stride along `in_features`.
            Shape: [num_rows, in_features]
        weight: from `pack_amx(w, gated=True)`.
            Shape: [2 * intermediate, in_features]
        bias: the bias (any float dtype), or None.
            Shape: [2 * intermediate]
    """
    if not weight.gated:
        raise ValueError("linear_amx_silu_mul: a weight packed gated")
    return _run(x, weight, bias, weight.out_features // 2, 2)


def lora_in_tiles(group: LoRAGroup) -> bool:
    """Whether `group`'s adapters can go inside the AMX linear (`linear_amx_lora`): every projection's B
    kept in rank pairs, every rank the step uses one AMX's tiles take, bf16, AMX allowed here."""
    from kernels import native

    return native.available() and bool(torch.ops.loragate_cpu.sgmv_group_tiles(group.native_plan))


def linear_amx_lora(
    x: torch.Tensor,
    weight: AMXWeight,
    bias: torch.Tensor | None,
    group: LoRAGroup,
    *,
    layer: int,
    silu: bool = False,
) -> torch.Tensor:
    """`linear_amx` plus `group`'s adapters (`lora_in_tiles(group)` must hold), or with `silu` (a gated
    weight) `linear_amx_silu_mul` with the adapters added before the SiLU; a new tensor.

    Semantics: `linear_amx(x, weight, bias)` then `kernels.sgmv.sgmv_group(y, x, group, layer=layer)` (then
    `silu_mul`), bit for bit: v = bf16(scale * x Aᵀ) per adapted row (`sgmv_group_shrink`), then each
    block's LoRA sums v Bᵀ from the tiles right after its own multiplies, `bf16(bf16(x Wᵀ + b) + v Bᵀ)`
    written once (`kernels/csrc/linear_amx_lora.h`).

    Args:
        x: the input rows, bf16, unit stride along `in_features`; the group's rows are its first rows.
            Shape: [num_rows, in_features]
        weight: from `pack_amx` (gated: the group's column offsets are in the weight's own order).
            Shape: [out_features, in_features]
        bias: the bias (any float dtype), or None.
            Shape: [out_features]
        group: the step's adapters of this projection (offsets into the output's columns).
        layer: the layer whose adapter weights apply.
        silu: `silu(g) * u` out, half as wide (a weight packed gated).
    """
    if silu and not weight.gated:
        raise ValueError("linear_amx_lora: the SiLU needs a weight packed gated")
    x = _rows(x)
    plan = group.native_plan
    v = torch.ops.loragate_cpu.sgmv_group_v(plan, x.shape[0])
    torch.ops.loragate_cpu.sgmv_group_shrink(v, x, plan, layer)
    mode = 2 if silu else 1 if weight.gated else 0
    out = torch.empty(
        x.shape[0], weight.out_features // 2 if silu else weight.out_features, dtype=torch.bfloat16
    )
    torch.ops.loragate_cpu.linear_amx_lora(out, x, weight.panels, bias, mode, v, plan, layer)
    return out


def linear_amx_argmax(x: torch.Tensor, weight: AMXWeight) -> torch.Tensor:
    """Each row's argmax over `x Wᵀ` rounded to bf16, without the products (a greedy LM head).

    Semantics: `kernels.glue.argmax_rows(linear_amx(x, weight))`: the first index of a row's largest value,
    or of its first NaN.

    Args:
        x: the input rows, bf16, unit stride along `in_features`.
            Shape: [num_rows, in_features]
        weight: from `pack_amx` (not gated).
            Shape: [out_features, in_features]
    Returns:
        int64 column indices.
            Shape: [num_rows]
    """
    if weight.gated:
        raise ValueError("linear_amx_argmax: a weight packed in its own column order (not gated)")
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    torch.ops.loragate_cpu.linear_amx_argmax(out, _rows(x), weight.panels, weight.out_features)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` with unit stride along its rows, as the kernel reads them (a copy only if need be)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _run(
    x: torch.Tensor, weight: AMXWeight, bias: torch.Tensor | None, width: int, mode: int
) -> torch.Tensor:
    """The kernel in `mode` (a gated weight's bias in the weight's own order: the kernel reads it there)."""
    out = torch.empty(x.shape[0], width, dtype=torch.bfloat16, device=x.device)
    torch.ops.loragate_cpu.linear_amx(out, _rows(x), weight.panels, bias, mode)
    return out
