"""Per-step paged-attention metadata: where each sequence's queries and context sit, built once per step.

A step's tokens come in two groups, decode (one query per sequence) then prefill (a chunk of queries per
sequence), each with an `AttentionMeta` shared by every layer. Worked example, block size 4: a prefill
group of two sequences whose contexts are 6 and 3 tokens, of which the last 2 and 3 are new this step:
`block_tables = [[7, 2], [5, 0]]` (the second row padded), `context_lens = [6, 3]`,
`query_start_loc = [0, 2, 5]`; the first sequence's queries `q[0:2]` sit at positions 4 and 5.
The torch path loops over sequences on the host: it reads the lengths as Python ints (given by the step's
builder, or read back once per meta and cached), so no layer reads them back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import torch


@dataclass(frozen=True)
class AttentionMeta:
    """One group of sequences in the paged KV cache (tensors on the compute device, int64).

    block_tables: [B, max_blocks]. Block ids per sequence; entries past a context may hold anything.
    context_lens: [B]. Tokens in each sequence's context, this step's new ones included.
    query_start_loc: [B + 1]. Start of each sequence's queries in the group's `q` (prefill); None for a
        decode group, whose sequences have one query each, `q[b]`.
    prompt_lens: [B]. Each sequence's prompt length (prefill groups, optional): its queries at positions
        below it are prompt tokens, the rest (a resumed request's generated ones) not. The native CPU
        kernel runs prompt rows on AMX tiles where it can (`kernels/csrc/prefill_tiles.h`).
    host_context_lens, host_query_start_loc: the same two on the host, optional (the builder has them).
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    host_context_lens: tuple[int, ...] | None = None
    host_query_start_loc: tuple[int, ...] | None = None

    @cached_property
    def context_lens_list(self) -> tuple[int, ...]:
        """`context_lens` on the host: given, or read back once for every layer."""
        given = self.host_context_lens
        return given if given is not None else tuple(self.context_lens.tolist())

    @cached_property
    def query_start_list(self) -> tuple[int, ...]:
        """`query_start_loc` on the host (prefill groups only)."""
        if self.host_query_start_loc is not None:
            return self.host_query_start_loc
        assert self.query_start_loc is not None, "a decode group has no query starts"
        return tuple(self.query_start_loc.tolist())

    @cached_property
    def by_length(self) -> tuple[tuple[int, ...], torch.Tensor]:
        """(context lengths longest first, ties in batch order; the sequence indices in that order)."""
        lens = self.context_lens_list
        order = sorted(range(len(lens)), key=lambda b: -lens[b])
        index = torch.tensor(order, dtype=torch.int64, device=self.context_lens.device)
        return tuple(lens[b] for b in order), index

    @cached_property
    def per_query(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill group as one row per query (`kernels.attention_native`'s prefill): each query's
        sequence index and the context it sees (its position + 1), `[T]` each, int64. In the worked
        example above: `([0, 0, 1, 1, 1], [5, 6, 1, 2, 3])`."""
        starts, lens = self.query_start_list, self.context_lens_list
        dev = self.context_lens.device
        counts = [e - s for s, e in pairwise(starts)]
        rows = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(counts, device=dev))
        first = torch.tensor([c - n + 1 for c, n in zip(lens, counts, strict=True)], device=dev)
        begin = torch.tensor(starts[:-1], device=dev) - starts[0]  # each sequence's first row
        return rows, first[rows] + torch.arange(starts[-1] - starts[0], device=dev) - begin[rows]

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
