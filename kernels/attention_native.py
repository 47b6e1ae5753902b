"""The native CPU path of paged attention and the KV write (`kernels/csrc/paged_decode_cpu.cpp`): one call
per layer for the whole decode batch, K/V read in place from the paged cache, q read in place from the
fused qkv rows; prefill as the same kernel over one row per new token (its sequence's block table, a
context of its position + 1: the causal mask by lengths). Same semantics as
`kernels.attention.paged_attention_decode` / `paged_attention_prefill` / `write_kv`; accumulation in fp32
whatever the storage dtype."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.attention_meta import AttentionMeta


def _attend(op: Callable[..., None], out: torch.Tensor, q: torch.Tensor, *inputs: object) -> None:
    """`op(out, q, *inputs)` on a contiguous output (copied into `out` after if it is not) and on q's rows
    in place when each row's heads are contiguous (slices of the fused qkv rows)."""
    if q.shape[0] == 0:
        return
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    op(target, q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous(), *inputs)
    if target is not out:
        out.copy_(target)


def paged_attention_decode_native(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    tables, lens = meta.block_tables.contiguous(), meta.context_lens.contiguous()
    _attend(
        torch.ops.loragate_cpu.paged_decode,
        out,
        q,
        k_cache.contiguous(),
        v_cache.contiguous(),
        tables,
        lens,
        scale,
        sliding_window or 0,
    )


def paged_attention_prefill_native(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Each query a decode row of its own: torch's fused SDPA, called once per sequence, ran short prompts
    at 7-18 G multiply-adds/s on two cores (its per-call work and threading); these rows 2-4x faster.
    Given each sequence's prompt length, its prompt rows run on AMX tiles where this CPU has them (bf16,
    head size 32, 64 or 128: `paged_prefill_prompt`), every other row as above."""
    if q.shape[0] == 0:
        return
    tables = meta.block_tables.contiguous()
    window = sliding_window or 0
    if meta.prompt_lens is not None and meta.query_start_loc is not None:
        _attend(
            torch.ops.loragate_cpu.paged_prefill_prompt,
            out,
            q,
            k_cache.contiguous(),
            v_cache.contiguous(),
            tables,
            meta.query_start_loc.contiguous(),
            meta.context_lens.contiguous(),
            meta.prompt_lens.contiguous(),
            scale,
            window,
        )
        return
    rows, lens = meta.per_query
    _attend(
        torch.ops.loragate_cpu.paged_prefill,
        out,
        q,
        k_cache.contiguous(),
        v_cache.contiguous(),
        tables,
        rows,
        lens,
        scale,
        window,
    )


def write_kv_native(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """One copy per token straight from the fused qkv rows (no `index_copy_` dispatch per tensor)."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()

    torch.ops.loragate_cpu.write_kv(k_cache, v_cache, rows(k), rows(v), slot_mapping.contiguous())
