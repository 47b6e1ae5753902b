# mypy: allow-untyped-defs
# (@triton.jit kernels take untyped pointers and scalars; their wrappers below are typed.)
"""Triton BGMV kernels (the GPU backend of `kernels.bgmv`): one program per token, in any slot order.

A decode token is a 1-row segment, too short for `tl.dot`'s 16-row minimum, so these kernels do
multiply-and-reduce on CUDA cores instead: each program gathers its token's slot, then streams that
adapter's weights against one activation row. The shrink splits its long reduction across programs
(split-K, fp32 atomics) when there are too few tokens to fill a Hopper GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_util import HOPPER_SMS, require_unit_last_stride


@triton.jit
def _bgmv_shrink_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    slots_ptr,
    scale_ptr,
    rank_ptr,
    H,
    R,
    stride_om,
    stride_xm,
    stride_ws,
    stride_wr,
    HAS_RANKS: tl.constexpr,
    ATOMIC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    rank = R
    if HAS_RANKS:
        rank = tl.load(rank_ptr + tl.maximum(slot, 0)).to(tl.int32)
    if (slot < 0) | (rank == 0):
        return
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < rank
    x_row = x_ptr + token * stride_xm
    w_ptrs = w_ptr + slot * stride_ws + cols[:, None] * stride_wr + ks[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(tl.program_id(1) * BLOCK_K, H, SPLIT_K * BLOCK_K):
        k_ok = (k0 + ks) < H
        xk = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        wk = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wk * xk[None, :], axis=1)
    acc *= tl.load(scale_ptr + slot).to(tl.float32)
    out_ptrs = out_ptr + token * stride_om + cols
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=col_ok)
    else:
        prev = tl.load(out_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (prev + acc).to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr,
    v_ptr,
    w_ptr,
    slots_ptr,
    rank_ptr,
    N,
    R,
    stride_ym,
    stride_vm,
    stride_ws,
    stride_wn,
    HAS_RANKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    rank = R
    if HAS_RANKS:
        rank = tl.load(rank_ptr + tl.maximum(slot, 0)).to(tl.int32)
    if (slot < 0) | (rank == 0):
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    v_row = v_ptr + token * stride_vm
    w_ptrs = w_ptr + slot * stride_ws + cols[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k_ok = (k0 + ks) < rank
        vk = tl.load(v_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        wk = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wk * vk[None, :], axis=1)
    y_ptrs = y_ptr + token * stride_ym + cols
    prev = tl.load(y_ptrs, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (prev + acc).to(y_ptr.dtype.element_ty), mask=col_ok)


def bgmv_shrink_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    layer: int,
    scale: torch.Tensor,
    ranks: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
) -> None:
    """`kernels.bgmv.bgmv_shrink` on the GPU; `split_k` overrides the heuristic (tests)."""
    num_tokens, hidden = x.shape
    weights = lora_a[layer]
    rank = weights.shape[1]
    if num_tokens == 0:
        return
    require_unit_last_stride(y=y, x=x, lora_a=weights)
    bn = triton.next_power_of_2(rank)
    # Keep the weight tile near 8K elements (registers of 4 warps) whatever the rank.
    bk = max(16, min(256, 8192 // bn, triton.next_power_of_2(hidden)))
    k_tiles = triton.cdiv(hidden, bk)
    splits = split_k or max(1, min(2 * HOPPER_SMS // num_tokens, k_tiles, 16))
    out = y if splits == 1 else torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    _bgmv_shrink_kernel[(num_tokens, splits)](
        out,
        x,
        weights,
        token_slots,
        scale,
        ranks if ranks is not None else token_slots,
        hidden,
        rank,
        out.stride(0),
        x.stride(0),
        weights.stride(0),
        weights.stride(1),
        HAS_RANKS=ranks is not None,
        ATOMIC=splits > 1,
        SPLIT_K=splits,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=4,
    )
    if splits > 1:
        y.add_(out)


def bgmv_expand_triton(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    layer: int,
    y_offset: int = 0,
    ranks: torch.Tensor | None = None,
) -> None:
    """`kernels.bgmv.bgmv_expand` on the GPU."""
    num_tokens = v.shape[0]
    weights = lora_b[layer]
    out_features, rank = weights.shape[1], weights.shape[2]
    if num_tokens == 0:
        return
    y_slice = y.narrow(1, y_offset, out_features)
    require_unit_last_stride(y=y_slice, v=v, lora_b=weights)
    bk = min(64, triton.next_power_of_2(rank))
    bn = max(16, min(256, 8192 // bk, triton.next_power_of_2(out_features)))
    _bgmv_expand_kernel[(num_tokens, triton.cdiv(out_features, bn))](
        y_slice,
        v,
        weights,
        token_slots,
        ranks if ranks is not None else token_slots,
        out_features,
        rank,
        y_slice.stride(0),
        v.stride(0),
        weights.stride(0),
        weights.stride(1),
        HAS_RANKS=ranks is not None,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=4,
    )
