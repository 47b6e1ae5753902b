"""Inputs and checks of the kernel tests: adapter popularity, LoRA stacks, paged KV caches, error metric.

Every builder takes a `torch.Generator`, so each test case draws fresh inputs from its own seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels import AttentionMeta, LoRABatchMeta, sgmv_expand, sgmv_shrink
from kernels.reference import attention_ref, gather_context, sgmv_expand_ref, sgmv_shrink_ref

# The Triton-interpreter test files (see conftest.py).
INTERPRETER_TESTS = "test_*_triton.py"
# "i/n": a pytest process with this set runs the i-th of n interleaved shards of the collected kernel tests
# (conftest.py), so n processes can share the interpreter's work.
SHARD_ENV = "LORAGATE_KERNEL_TEST_SHARD"
POPULARITIES = ("distinct", "uniform", "zipf", "identical", "skewed")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN, so failing, when a poisoned element was never written)."""
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def sequence_slots(popularity: str, num_seqs: int, num_slots: int, gen: torch.Generator) -> list[int]:
    """One adapter slot per sequence, drawn by `popularity`."""
    if popularity == "distinct":  # every sequence its own adapter (cycling once the slots run out)
        perm = torch.randperm(num_slots, generator=gen).tolist()
        return [perm[i % num_slots] for i in range(num_seqs)]
    if popularity == "identical":
        return [int(torch.randint(num_slots, (1,), generator=gen))] * num_seqs
    if popularity == "uniform":
        weights = torch.ones(num_slots)
    elif popularity == "zipf":
        weights = torch.tensor([1.0 / (i + 1) for i in range(num_slots)])
    elif popularity == "skewed":
        weights = torch.full((num_slots,), 0.1 / max(num_slots - 1, 1))
        weights[0] = 0.9
    else:
        raise ValueError(popularity)
    return torch.multinomial(weights, num_seqs, replacement=True, generator=gen).tolist()


def token_slots(
    popularity: str,
    seq_lens: list[int],
    num_slots: int,
    gen: torch.Generator,
    base_share: float = 0.0,
    grouped: bool = True,
) -> list[int]:
    """Per-token slots of sequences of `seq_lens` tokens; a `base_share` of sequences use no adapter (-1).

    `grouped` orders the sequences by slot, as the engine lays out a batch; otherwise arrival order.
    """
    slots = sequence_slots(popularity, len(seq_lens), num_slots, gen)
    base = torch.rand(len(seq_lens), generator=gen) < base_share
    slots = [-1 if b else s for s, b in zip(slots, base.tolist(), strict=True)]
    seqs = list(zip(slots, seq_lens, strict=True))
    if grouped:
        seqs.sort(key=lambda sl: sl[0])
    return [s for s, n in seqs for _ in range(n)]


@dataclass(frozen=True)
class LoRAStack:
    a: torch.Tensor  # [L, S, R, H_in]
    b: torch.Tensor  # [L, S, N, R]
    scale: torch.Tensor  # [S] float32
    ranks: list[int]  # true rank per slot; weights are zero past it


def lora_stack(
    layers: int,
    ranks: list[int],
    hidden: int,
    out: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    max_rank: int | None = None,
    padding: float = 0.0,
) -> LoRAStack:
    """Weights past each slot's rank hold `padding`: zero, or NaN to prove a rank table is honoured."""
    r_max = max_rank or max(ranks)
    a = torch.randn(layers, len(ranks), r_max, hidden, generator=gen) / hidden**0.5
    b = torch.randn(layers, len(ranks), out, r_max, generator=gen) / r_max**0.5
    for s, r in enumerate(ranks):
        a[:, s, r:] = padding
        b[:, s, :, r:] = padding
    scale = torch.rand(len(ranks), generator=gen) + 0.5
    return LoRAStack(a.to(dtype), b.to(dtype), scale, ranks)


@dataclass(frozen=True)
class PagedKV:
    k: torch.Tensor  # [NB, BS, KVH, D]
    v: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int64; past-context entries are junk
    tables: list[list[int]]  # the real blocks of each sequence

    def on(self, device: str) -> PagedKV:
        return replace(
            self, k=self.k.to(device), v=self.v.to(device), block_tables=self.block_tables.to(device)
        )


def paged_kv(
    ctx_lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedKV:
    """A cache holding each sequence's context in shuffled blocks, plus spare blocks of noise."""
    counts = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(counts) + 3
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for c in counts:
        tables.append(perm[used : used + c])
        used += c
    width = max(counts) + 1
    junk = [-1, num_blocks + 7]
    rows = [t + [junk[i % 2]] * (width - len(t)) for i, t in enumerate(tables)]
    return PagedKV(k, v, torch.tensor(rows, dtype=torch.int64), tables)


# 16 slots each; rank 0 = a slot whose adapter does not target this module.
RANK_SETS = {
    "r8": [8] * 16,
    "mixed": [8, 16, 32, 64, 0, 24, 48, 8, 16, 32, 64, 12, 8, 16, 40, 56],
    "r64": [64] * 16,
}


@dataclass(frozen=True)
class LoRACase:
    """One projection's inputs: `slots` per token, poisoned outputs `y0` (shrink) and `out0` (expand)."""

    slots: list[int]
    x: torch.Tensor  # [T, H]
    stack: LoRAStack
    ranks: torch.Tensor | None  # the rank table passed to the kernel, or None (padded weights)
    v: torch.Tensor  # [T, R] expand input
    y0: torch.Tensor  # [T, R]
    out0: torch.Tensor  # [T, offset + N + 8]
    offset: int
    layer: int = 1

    def on(self, device: str) -> LoRACase:
        """This case with its tensors on `device` (the checks read the CPU original)."""
        stack = self.stack
        return replace(
            self,
            x=self.x.to(device),
            stack=replace(stack, a=stack.a.to(device), b=stack.b.to(device), scale=stack.scale.to(device)),
            ranks=self.ranks.to(device) if self.ranks is not None else None,
            v=self.v.to(device),
            y0=self.y0.to(device),
            out0=self.out0.to(device),
        )


def lora_case(
    popularity: str,
    base_share: float,
    dtype: torch.dtype,
    seed: int,
    *,
    rank_set: str = "mixed",
    rank_table: bool = True,
    grouped: bool = True,
    num_seqs: int = 7,
    max_len: int = 9,
    hidden: int = 48,
    out: int = 40,
) -> LoRACase:
    gen = torch.Generator().manual_seed(seed)
    ranks = RANK_SETS[rank_set]
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen).tolist()
    slots = token_slots(popularity, seq_lens, len(ranks), gen, base_share, grouped)
    num_tokens = len(slots)
    stack = lora_stack(2, ranks, hidden, out, dtype, gen, padding=float("nan") if rank_table else 0.0)
    r_max = stack.a.shape[2]
    offset = 8
    return LoRACase(
        slots=slots,
        x=torch.randn(num_tokens, hidden, generator=gen).to(dtype),
        stack=stack,
        ranks=torch.tensor(ranks, dtype=torch.int64) if rank_table else None,
        v=torch.randn(num_tokens, r_max, generator=gen).to(dtype),
        y0=torch.randn(num_tokens, r_max, generator=gen).to(dtype),
        out0=torch.randn(num_tokens, offset + out + 8, generator=gen).to(dtype),
        offset=offset,
    )


def shrink_untouched(case: LoRACase) -> torch.Tensor:
    """Where a shrink must leave `y0` bit-exact: rows without an adapter, columns past the slot's rank."""
    mask = torch.zeros(case.y0.shape, dtype=torch.bool)
    for t, s in enumerate(case.slots):
        mask[t, case.stack.ranks[s] if s >= 0 else 0 :] = True
    return mask


def expand_untouched(case: LoRACase) -> torch.Tensor:
    """Where an expand must leave `out0` bit-exact: outside the column slice, and rows without an adapter
    or of a rank-0 slot."""
    n = case.stack.b.shape[2]
    mask = torch.ones(case.out0.shape, dtype=torch.bool)
    for t, s in enumerate(case.slots):
        if s >= 0 and case.stack.ranks[s] > 0:
            mask[t, case.offset : case.offset + n] = False
    return mask


def decode_reference(
    q: torch.Tensor, kv: PagedKV, ctx_lens: list[int], scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """float64 `[B, H, D]`: each sequence's one query at the last position of its context."""
    rows = []
    for b, c in enumerate(ctx_lens):
        k = gather_context(kv.k, kv.tables[b], c)
        v = gather_context(kv.v, kv.tables[b], c)
        rows.append(attention_ref(q[b : b + 1], k, v, [c - 1], scale, sliding_window))
    return torch.cat(rows)


def prefill_reference(
    q: torch.Tensor,
    kv: PagedKV,
    q_lens: list[int],
    ctx_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """float64 `[T, H, D]`: each sequence's queries at the last `q_lens[b]` positions of its context."""
    rows, start = [], 0
    for b, (n, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        k = gather_context(kv.k, kv.tables[b], c)
        v = gather_context(kv.v, kv.tables[b], c)
        positions = list(range(c - n, c))
        rows.append(attention_ref(q[start : start + n], k, v, positions, scale, sliding_window))
        start += n
    return torch.cat(rows)


def query_start_loc(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)


def decode_meta(kv: PagedKV, ctx_lens: list[int], device: str = "cpu") -> AttentionMeta:
    return AttentionMeta(kv.block_tables.to(device), torch.tensor(ctx_lens, device=device))


def prefill_meta(kv: PagedKV, q_lens: list[int], ctx_lens: list[int], device: str = "cpu") -> AttentionMeta:
    lens, starts = torch.tensor(ctx_lens, device=device), query_start_loc(q_lens).to(device)
    return AttentionMeta(kv.block_tables.to(device), lens, query_start_loc=starts)


def run_sgmv_shrink(case: LoRACase, device: str = "cpu") -> torch.Tensor:
    """The public `sgmv_shrink` (whichever backend is selected) on a copy of the poisoned output."""
    c = case.on(device)
    meta = LoRABatchMeta.from_token_slots(case.slots, device)
    y = c.y0.clone()
    sgmv_shrink(y, c.x, c.stack.a, meta, layer=c.layer, scale=c.stack.scale, ranks=c.ranks)
    return y.cpu()


def run_sgmv_expand(case: LoRACase, device: str = "cpu") -> torch.Tensor:
    c = case.on(device)
    meta = LoRABatchMeta.from_token_slots(case.slots, device)
    y = c.out0.clone()
    sgmv_expand(y, c.v, c.stack.b, meta, layer=c.layer, y_offset=c.offset, ranks=c.ranks)
    return y.cpu()


def check_shrink(case: LoRACase, y: torch.Tensor) -> None:
    """Within tolerance of the float64 reference, and bit-exact where nothing may change."""
    ref = case.y0.double() + sgmv_shrink_ref(
        case.x, case.stack.a, case.slots, case.layer, case.stack.scale, case.stack.ranks
    )
    assert rel_err(y, ref) < TOLERANCE[case.x.dtype]
    untouched = shrink_untouched(case)
    assert torch.equal(y[untouched], case.y0[untouched])


def check_expand(case: LoRACase, y: torch.Tensor) -> None:
    ref = sgmv_expand_ref(
        case.out0, case.v, case.stack.b, case.slots, case.layer, case.offset, case.stack.ranks
    )
    assert rel_err(y, ref) < TOLERANCE[case.v.dtype]
    untouched = expand_untouched(case)
    assert torch.equal(y[untouched], case.out0[untouched])
