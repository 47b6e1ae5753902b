"""The flattened inputs of one forward pass, built by the engine from the scheduler's choice.

Token layout: decode sequences first (one generated token each), then prefill chunks (prompt tokens, a
prompt's last token alone included, and a resumed request's generated ones); within each group the
sequences are ordered by adapter slot so LoRA segments are long and few (at most 2 × adapters per step).

Logits rows: one per sequence that samples this step (in `sampled_seqs` order), then, for sequences that
want prompt logprobs, one per prompt position of their chunk whose logits are still wanted
(`PromptRows`): position p's logits give prompt token p + 1 its logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels import AttentionMeta, LoRABatchMeta
from worker.device import host_to_device
from worker.sequence import Sequence


@dataclass(frozen=True)
class PromptRows:
    """`count` logits rows, from row `row` on, of `seq`'s prompt positions `first`, `first + 1`, ..."""

    seq: Sequence
    first: int
    count: int
    row: int


@dataclass(frozen=True)
class ForwardBatch:
    """Everything the model runner reads for one step; tensors are on the compute device.

    input_ids, positions, slot_mapping: [T] int64.
    num_decode: the first `num_decode` tokens are decode tokens, one per sequence.
    decode: attention metadata of the decode sequences (`num_decode` of them).
    num_prefill_seqs: sequences in the prefill group, whose tokens follow the decode tokens.
    prefill: attention metadata of the prefill sequences; `query_start_loc` is relative to token
        `num_decode`.
    logits_indices: [N] rows whose next-token logits are needed: one per sampled sequence, then the
        prompt rows.
    lora: segment metadata, or None when no token uses an adapter.
    prompt_rows: where the prompt-logprob rows of each sequence that wants them lie among the logits.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode: int
    decode: AttentionMeta
    num_prefill_seqs: int
    prefill: AttentionMeta
    logits_indices: torch.Tensor
    lora: LoRABatchMeta | None
    prompt_rows: tuple[PromptRows, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def pad_block_tables(tables: list[list[int]]) -> tuple[list[int], int]:
    """The tables as one row-major list padded with block 0, and its width."""
    width = max((len(t) for t in tables), default=0)
    return [b for t in tables for b in (*t, *[0] * (width - len(t)))], width


def pack_int64(parts: list[list[int]], device: str) -> list[torch.Tensor]:
    """The lists as int64 tensors on `device`, moved in one host-to-device copy and sliced there. Each
    slice starts 16-byte aligned (Triton specialises kernels on pointer alignment: one variant, not many).
    """
    padded = [v for part in parts for v in (*part, *[0] * (len(part) % 2))]
    flat = host_to_device(padded, torch.int64, device)
    chunks = flat.split([len(part) + len(part) % 2 for part in parts])
    return [chunk[: len(part)] for chunk, part in zip(chunks, parts, strict=True)]


def build_forward_batch(
    scheduled: list[tuple[Sequence, int]], block_size: int, device: str
) -> tuple[ForwardBatch, list[tuple[Sequence, int]], list[Sequence]]:
    """Lay out the step's tokens; returns the batch, the (sequence, tokens) order used, and the
    sequences that sample a token this step, in `logits_indices` order."""

    # A decode row is a generated token's; a prompt's last token scheduled alone (the rest cached) is a
    # prefill row, so that it attends as its prompt's other rows do (`AttentionMeta.prompt_lens`).
    def is_decode(x: tuple[Sequence, int]) -> bool:
        return x[1] == 1 and x[0].num_computed_tokens >= x[0].num_prompt_tokens

    decode = sorted((x for x in scheduled if is_decode(x)), key=lambda x: x[0].lora_slot)
    prefill = sorted((x for x in scheduled if not is_decode(x)), key=lambda x: x[0].lora_slot)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    token_lora: list[int] = []
    logits_rows: list[int] = []
    sampled_seqs: list[Sequence] = []
    prompt_rows: list[int] = []
    prompt_spans: list[PromptRows] = []
    for seq, n in (*decode, *prefill):
        start = seq.num_computed_tokens
        table = seq.block_table
        ids.extend(seq.token_ids[start : start + n])
        span = range(start, start + n)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        token_lora.extend([seq.lora_slot] * n)
        if start + n == seq.num_tokens:
            logits_rows.append(len(ids) - 1)
            sampled_seqs.append(seq)
        first, end = max(start, seq.next_prompt_logit), min(start + n, seq.num_prompt_tokens - 1)
        if first < end:
            prompt_spans.append(PromptRows(seq, first, end - first, len(prompt_rows)))
            prompt_rows.extend(range(len(ids) - n + first - start, len(ids) - n + end - start))
    query_starts = [0]
    for _, n in prefill:
        query_starts.append(query_starts[-1] + n)
    decode_tables, decode_width = pad_block_tables([s.block_table for s, _ in decode])
    prefill_tables, prefill_width = pad_block_tables([s.block_table for s, _ in prefill])
    has_lora = any(s >= 0 for s in token_lora)
    seg_indptr, seg_slots, segments = LoRABatchMeta.runs(token_lora) if has_lora else ([], [], ())
    parts = [
        ids,
        positions,
        slots,
        decode_tables,
        [s.num_computed_tokens + 1 for s, _ in decode],
        prefill_tables,
        query_starts,
        [s.num_computed_tokens + n for s, n in prefill],
        [*logits_rows, *prompt_rows],
        seg_indptr,
        seg_slots,
        [s.num_prompt_tokens for s, _ in prefill],
    ]
    t = pack_int64(parts, device)
    batch = ForwardBatch(
        input_ids=t[0],
        positions=t[1],
        slot_mapping=t[2],
        num_decode=len(decode),
        decode=AttentionMeta(
            block_tables=t[3].view(len(decode), decode_width),
            context_lens=t[4],
            host_context_lens=tuple(parts[4]),
        ),
        num_prefill_seqs=len(prefill),
        prefill=AttentionMeta(
            block_tables=t[5].view(len(prefill), prefill_width),
            context_lens=t[7],
            query_start_loc=t[6],
            prompt_lens=t[11],
            host_context_lens=tuple(parts[7]),
            host_query_start_loc=tuple(query_starts),
        ),
        logits_indices=t[8],
        lora=LoRABatchMeta(t[9], t[10], segments) if has_lora else None,
        prompt_rows=tuple(replace(r, row=r.row + len(logits_rows)) for r in prompt_spans),
    )
    return batch, [*decode, *prefill], sampled_seqs
