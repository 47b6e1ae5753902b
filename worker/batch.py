"""The flattened inputs of one forward pass, built by the engine from the scheduler's choice.

Token layout: decode sequences first (one token each), then prefill chunks; within each group the
sequences are ordered by adapter slot so LoRA segments are long and few (at most 2 × adapters per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import LoRABatchMeta
from worker.sequence import Sequence


@dataclass(frozen=True)
class ForwardBatch:
    """Everything the model runner reads for one step; tensors are on the compute device.

    input_ids, positions, slot_mapping: [T] int64.
    num_decode: the first `num_decode` tokens are decode tokens, one per sequence.
    decode_block_tables: [num_decode, max_blocks]; decode_context_lens: [num_decode].
    prefill_block_tables: [num_prefill_seqs, max_blocks]; prefill_query_start_loc: [num_prefill_seqs + 1]
        relative to token `num_decode`; prefill_context_lens: [num_prefill_seqs].
    logits_indices: [N] rows whose next-token logits are needed (one per sampling sequence).
    lora: segment metadata, or None when no token uses an adapter.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    num_prefill_seqs: int
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_context_lens: torch.Tensor
    logits_indices: torch.Tensor
    lora: LoRABatchMeta | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def pad_block_tables(tables: list[list[int]], device: str) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(tables), width)


def build_forward_batch(
    scheduled: list[tuple[Sequence, int]], block_size: int, device: str
) -> tuple[ForwardBatch, list[tuple[Sequence, int]], list[Sequence]]:
    """Lay out the step's tokens; returns the batch, the (sequence, tokens) order used, and the
    sequences that sample a token this step, in `logits_indices` order."""
    decode = sorted((x for x in scheduled if x[1] == 1), key=lambda x: x[0].lora_slot)
    prefill = sorted((x for x in scheduled if x[1] > 1), key=lambda x: x[0].lora_slot)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    token_lora: list[int] = []
    logits_rows: list[int] = []
    samplers: list[Sequence] = []
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
            samplers.append(seq)
    query_starts = [0]
    for _, n in prefill:
        query_starts.append(query_starts[-1] + n)

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    batch = ForwardBatch(
        input_ids=longs(ids),
        positions=longs(positions),
        slot_mapping=longs(slots),
        num_decode=len(decode),
        decode_block_tables=pad_block_tables([s.block_table for s, _ in decode], device),
        decode_context_lens=longs([s.num_computed_tokens + 1 for s, _ in decode]),
        num_prefill_seqs=len(prefill),
        prefill_block_tables=pad_block_tables([s.block_table for s, _ in prefill], device),
        prefill_query_start_loc=longs(query_starts),
        prefill_context_lens=longs([s.num_computed_tokens + n for s, n in prefill]),
        logits_indices=longs(logits_rows),
        lora=LoRABatchMeta.from_token_slots(token_lora, device) if any(s >= 0 for s in token_lora) else None,
    )
    return batch, [*decode, *prefill], samplers
