"""Per-step paged-attention metadata: where each sequence's queries and context sit, built once per step.

A step's tokens come in two groups, decode (one query per sequence) then prefill (a chunk of queries per
sequence), each with an `AttentionMeta` shared by every layer. Worked example, block size 4: a prefill
group of two sequences whose contexts are 6 and 3 tokens, of which the last 2 and 3 are new this step:
`block_tables = [[7, 2], [5, 0]]` (the second row padded), `context_lens = [6, 3]`,
`query_start_loc = [0, 2, 5]`; the first sequence's queries `q[0:2]` sit at positions 4 and 5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMeta:
    """One group of sequences in the paged KV cache (tensors on the compute device, int64).

    block_tables: [B, max_blocks]. Block ids per sequence; entries past a context may hold anything.
    context_lens: [B]. Tokens in each sequence's context, this step's new ones included.
    query_start_loc: [B + 1]. Start of each sequence's queries in the group's `q` (prefill); None for a
        decode group, whose sequences have one query each, `q[b]`.
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
