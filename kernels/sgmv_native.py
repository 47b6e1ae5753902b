"""The native CPU path of the SGMV kernels (`kernels/csrc/sgmv_cpu.cpp`): one call per projection applies
every segment's adapter, no Python loop over segments and no BLAS call per segment (at decode sizes a
BLAS call's fixed cost exceeds the few thousand multiply-adds of a segment). Same semantics as
`kernels.sgmv`; fp32 accumulation. `lora_b` is fastest stored `[L, S, R, N]` and passed as its transpose
(what `worker.adapter_cache` keeps on a CPU): the expand is then an axpy per rank over contiguous outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora_meta import LoRABatchMeta, LoRAGroup


def _ranks(ranks: torch.Tensor | None, slots: int, rank: int) -> torch.Tensor:
    if ranks is None:
        return torch.full((slots,), rank, dtype=torch.int64)
    return ranks.to(torch.int64).contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def sgmv_shrink_native(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    weights = lora_a[layer].contiguous()
    target = _rows(y)
    torch.ops.loragate_cpu.sgmv_shrink(
        target,
        _rows(x),
        weights,
        meta.segment_table,
        _ranks(ranks, weights.shape[0], weights.shape[1]),
        scale.to(torch.float32).contiguous(),
    )
    if target is not y:
        y.copy_(target)


def sgmv_expand_native(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRABatchMeta,
    *,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
) -> None:
    weights = lora_b[layer]
    out = y.narrow(1, y_offset, weights.shape[1])
    target = _rows(out)
    torch.ops.loragate_cpu.sgmv_expand(
        target, _rows(v), weights, meta.segment_table, _ranks(ranks, weights.shape[0], weights.shape[2])
    )
    if target is not out:
        out.copy_(target)


def group_plan(group: LoRAGroup) -> torch.Tensor:
    """`group`'s step checked and laid out for the native kernel, as an opaque byte tensor that holds the
    tensors it reads (never write to it): every projection's A and B stacks (and B in rank pairs where
    every projection has them), slot tables, output offsets, and the segments cut into work chunks. Made
    once per step (`LoRAGroup.native_plan`); each layer's call then passes its input, output and layer."""
    pairs = [p.b_pairs for p in group.projections]
    return torch.ops.loragate_cpu.sgmv_group_plan(
        [p.a for p in group.projections],
        [p.b for p in group.projections],
        [t for t in pairs if t is not None] if all(t is not None for t in pairs) else [],
        group.rank_table,
        group.scale_table,
        [p.y_offset for p in group.projections],
        group.meta.segment_table,
    )


def sgmv_group_native(y: torch.Tensor, x: torch.Tensor, group: LoRAGroup, *, layer: int) -> None:
    target = _rows(y)
    torch.ops.loragate_cpu.sgmv_group_run(target, _rows(x), group.native_plan, layer)
    if target is not y:
        y.copy_(target)


def bf16_pairs_ready() -> bool:
    """Whether the native bf16 kernels read B in rank pairs (`rank_pairs`) here, where every projection has
    them: on AMX tiles (`amx_ready`) or, on a CPU with AVX512-BF16 but no AMX (AMD Zen 4 and later), on
    `vdpbf16ps`'s pair dot products (`kernels/csrc/sgmv_dpbf16.h`)."""
    from kernels import native

    return native.available() and bool(torch.ops.loragate_cpu.bf16_pairs_ready())


def amx_ready() -> bool:
    """Whether the native bf16 kernels run on AMX tiles here (built, on Intel Sapphire Rapids or later,
    allowed by the OS): where they do, a B stack kept in rank pairs (`rank_pairs`) is read instead of B."""
    from kernels import native

    return native.available() and bool(torch.ops.loragate_cpu.amx_ready())


def rank_pairs(b: torch.Tensor) -> torch.Tensor:
    """B `[..., out, R]` (any strides) in rank pairs per 16 outputs, `[..., out / 16, ceil(R / 2), 32]`
    contiguous: element `[..., o // 16, p, 2 * (o % 16) + e]` is `b[..., o, 2p + e]` (zero past R). The
    operand layout of AMX's `tdpbf16ps`: each 64-byte row holds 16 outputs' pairs of consecutive ranks."""
    *lead, out, rank = b.shape
    if out % 16:
        raise ValueError(f"rank_pairs: {out} outputs are not a multiple of 16")
    if rank % 2:
        b = torch.nn.functional.pad(b, (0, 1))
        rank += 1
    pairs = b.reshape(*lead, out // 16, 16, rank // 2, 2).transpose(-3, -2)
    return pairs.reshape(*lead, out // 16, rank // 2, 32).contiguous()


def slot_pairs(b: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """B stacks `[L, S, out, R]` in rank pairs as the native bf16 kernel reads them on AMX,
    `[L, S, out / 16, ceil(R / 2), 32]` contiguous: slot s holds `rank_pairs` of its own `ranks[s]` ranks
    only, packed densely at the start of its region (`write_slot_pairs`), zeros after. A slot of rank r is
    then one contiguous run of `out * ceil(r / 2) * 4` bytes per layer, however large the stack's rank:
    padded to the stack's rank, a rank-16 slot of a rank-64 stack read 512 of every 2,048 bytes."""
    layers, slots, out, rank = b.shape
    pairs = b.new_zeros(layers, slots, out // 16, (rank + 1) // 2, 32)
    for slot, r in enumerate(ranks):
        write_slot_pairs(pairs[:, slot], b[:, slot], int(r))
    return pairs


def write_slot_pairs(region: torch.Tensor, b: torch.Tensor, rank: int) -> None:
    """One slot's B `[L, out, R]` of rank `rank` into its region `[L, out / 16, ceil(R / 2), 32]` of a
    `slot_pairs` stack: `rank_pairs(b[..., :rank])` flat at the region's start, zeros after it."""
    region.zero_()
    if rank == 0:
        return
    dense = rank_pairs(b[..., :rank]).reshape(b.shape[0], -1)
    region.view(b.shape[0], -1)[:, : dense.shape[1]] = dense
