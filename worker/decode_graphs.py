"""Whole-decode steps replayed from CUDA graphs: one captured forward per (batch bucket, LoRA or not).

Why: on a GPU a small model's decode step is bound by the host, not the device (docs/BENCHMARKS.md, "GPU
again": ~300 kernel launches per step kept the GPU busy ~10 % of the time). A graph replays a step's
launches in one call, as vLLM's and SGLang's decode graphs do.

How:
- Static inputs. One set of device buffers, sized for the largest bucket, that every graph reads: token
  ids, positions, KV slots, context lengths, block tables of the full width (`max_model_len` tokens), the
  logits rows and the LoRA segments.
- Buckets. A step of `n` decode sequences runs the graph of the smallest bucket `B >= n` (1, 2, 4, then
  every multiple of 8 up to `max_num_seqs`). Its metadata is copied into the buffers' first `n` rows
  (device to device, from the step's own `ForwardBatch`); rows `n .. B-1` are padding: context 1, no
  adapter, their keys and values written to the KV pool's spare block (`KVCache.pad_slot`), their logits
  never read. A bucket has `min(B, max_loras + 2)` LoRA segments: the step's own runs of one slot (base
  tokens first, then a run per slot: at most `max_loras + 1`), then the padding's (slot -1), then empty
  ones; the kernels skip slot -1 and empty segments.
- LoRA. A graph with LoRA adapts every module that has a slot stack; a slot that does not adapt a module
  has rank 0 there and the kernels skip it (adds nothing). The graph reads the slots' weights, ranks and
  scales where they live (the projection table holds the stacks' addresses, and the rank and scale tables
  are stacked inside the graph), so loading an adapter into a slot changes what the next replay computes,
  never the graph.
- What replays: only whole-decode steps (every token a sequence's next, every one sampled, no prompt
  logprobs) of at most `max_num_seqs` sequences; prefill and mixed steps run eagerly.
- Capture. Largest bucket first, every graph in one memory pool (only one replays at a time; its output
  is read before the next). A graph ends at the final norm: the LM head runs eagerly on the real rows
  only, so the graphs hold `[B, hidden]` outputs, not `[B, vocab]` logits (for a 150k vocabulary and 35
  buckets those would be gigabytes). Each capture follows an eager run on the same buffers, which compiles
  any Triton variant the static shapes need (nothing compiles inside a capture).

Off a GPU the same static path runs uncaptured (`capture=False`): what a test can prove on a CPU with the
Triton kernels under the interpreter (bucketing, padding, segments, the spare block), since the torch and
native CPU kernels read per-step metadata on the host that static buffers do not carry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels import AttentionMeta, LoRABatchMeta, LoRAGroup
from kernels.backend import use_triton
from worker.adapter_cache import AdapterCache
from worker.batch import ForwardBatch
from worker.model import ModelRunner

Captured = tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[str, LoRAGroup]]  # graph, output, its groups


def use_graphs(setting: bool | None, probe: torch.Tensor) -> bool:
    """Whether an engine whose tensors are like `probe` runs its decode steps through `DecodeGraphs`
    (`EngineConfig.cuda_graphs`: None means on a CUDA device with the Triton kernels)."""
    triton = use_triton(probe)
    if setting is None:
        return probe.is_cuda and triton
    if setting and not triton:
        raise ValueError(
            "cuda_graphs needs the Triton kernels: a CUDA device, or LORAGATE_KERNEL_BACKEND=triton under "
            "TRITON_INTERPRET=1"
        )
    return setting


def decode_buckets(max_seqs: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: 1, 2, 4, then multiples of 8, and `max_seqs` itself."""
    sizes = {b for b in (1, 2, 4) if b <= max_seqs} | set(range(8, max_seqs + 1, 8)) | {max_seqs}
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class StaticDecode:
    """The device buffers every graph reads (int64, rows for the largest bucket `B`, `S` segments).

    ids, positions, slots, context_lens, rows: [B]; block_tables: [B, max blocks per sequence];
    seg_indptr: [S + 1]; slot_ids: [S].
    """

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    rows: torch.Tensor
    seg_indptr: torch.Tensor
    slot_ids: torch.Tensor


@dataclass(frozen=True)
class GraphReport:
    graphs: int
    seconds: float


class DecodeGraphs:
    def __init__(
        self,
        runner: ModelRunner,
        adapters: AdapterCache,
        max_seqs: int,
        max_model_len: int,
        capture: bool,
    ):
        self.runner, self.adapters, self.capture = runner, adapters, capture
        self.buckets = decode_buckets(max_seqs)
        self.pad_slot = runner.kv.pad_slot
        device = runner.w.embed.device
        rows, width = self.buckets[-1], -(-max_model_len // runner.kv.block_size)
        segments = min(rows, adapters.num_slots + 2)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.static = StaticDecode(
            ids=zeros(rows),
            positions=zeros(rows),
            slots=torch.full((rows,), self.pad_slot, dtype=torch.int64, device=device),
            context_lens=torch.ones(rows, dtype=torch.int64, device=device),
            block_tables=zeros(rows, width),
            rows=torch.arange(rows, dtype=torch.int64, device=device),
            seg_indptr=torch.full((segments + 1,), rows, dtype=torch.int64, device=device),
            slot_ids=torch.full((segments,), -1, dtype=torch.int64, device=device),
        )
        # Each graph with its output and the LoRA groups it reads: their projection tables were made
        # outside the capture, and a graph replays reads of their memory, so they live as long as it.
        self.graphs: dict[tuple[int, bool], Captured] = {}
        self.report: GraphReport | None = None

    # -- capture --------------------------------------------------------------------------------
    def capture_all(self) -> GraphReport:
        """Capture every bucket's graphs, with and without LoRA (a no-op without `capture`)."""
        start = time.perf_counter()
        if self.capture:
            pool = torch.cuda.graph_pool_handle()
            for bucket in reversed(self.buckets):
                for lora in (False, True):
                    self._pad(0, bucket)
                    fb = self.static_batch(bucket)
                    self.runner.hidden(fb, self._groups(fb, lora))  # compiles outside the capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    groups = self._groups(fb, lora)  # fresh: its rank and scale tables stacked in the graph
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.runner.hidden(fb, groups)
                    self.graphs[(bucket, lora)] = (graph, out, groups)
            torch.cuda.synchronize()
        self.report = GraphReport(len(self.graphs), time.perf_counter() - start)
        return self.report

    def static_batch(self, bucket: int) -> ForwardBatch:
        """A decode batch of `bucket` sequences over the first rows of the static buffers."""
        s = self.static
        segments = min(bucket, s.slot_ids.shape[0])
        empty = s.block_tables[:0]
        return ForwardBatch(
            input_ids=s.ids[:bucket],
            positions=s.positions[:bucket],
            slot_mapping=s.slots[:bucket],
            num_decode=bucket,
            decode=AttentionMeta(block_tables=s.block_tables[:bucket], context_lens=s.context_lens[:bucket]),
            num_prefill_seqs=0,
            prefill=AttentionMeta(empty, s.context_lens[:0], query_start_loc=s.rows[:1]),
            logits_indices=s.rows[:bucket],
            lora=LoRABatchMeta(s.seg_indptr[: segments + 1], s.slot_ids[:segments], ()),
        )

    def _groups(self, fb: ForwardBatch, lora: bool) -> dict[str, LoRAGroup]:
        """Every fused projection's group over every module with a stack, its projection table made here
        (a host-to-device copy may not happen inside a capture)."""
        if not lora:
            return {}
        assert fb.lora is not None
        stacks = self.adapters.stacks
        groups = self.runner.build_groups(stacks, dict.fromkeys(stacks, fb.lora), fb.lora)
        for group in groups.values():
            _ = group.projection_table
        return groups

    # -- replay ---------------------------------------------------------------------------------
    def fits(self, batch: ForwardBatch, sampled: int) -> bool:
        """True when `batch` is a whole-decode step a graph can run."""
        return (
            batch.num_prefill_seqs == 0
            and not batch.prompt_rows
            and 0 < batch.num_decode == sampled <= self.buckets[-1]
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of `batch` (which `fits`), one row per sequence, from its bucket's graph."""
        n = batch.num_decode
        bucket = next(b for b in self.buckets if b >= n)
        s = self.static
        s.ids[:n].copy_(batch.input_ids)
        s.positions[:n].copy_(batch.positions)
        s.slots[:n].copy_(batch.slot_mapping)
        s.context_lens[:n].copy_(batch.decode.context_lens)
        tables = batch.decode.block_tables
        s.block_tables[:n, : tables.shape[1]].copy_(tables)
        self._pad(n, bucket)
        lora = batch.lora is not None
        if batch.lora is not None:
            k = batch.lora.slot_ids.shape[0]
            s.seg_indptr[: k + 1].copy_(batch.lora.seg_indptr)
            s.seg_indptr[k + 1 :].fill_(bucket)
            s.slot_ids[:k].copy_(batch.lora.slot_ids)
            s.slot_ids[k:].fill_(-1)
        if not self.capture:
            fb = self.static_batch(bucket)
            return self.runner.logits(self.runner.hidden(fb, self._groups(fb, lora))[:n])
        graph, out, _ = self.graphs[(bucket, lora)]
        graph.replay()
        return self.runner.logits(out[:n])

    def _pad(self, n: int, bucket: int) -> None:
        """Rows `n .. bucket-1` become padding: context 1 and their KV written to the spare block."""
        if n < bucket:
            self.static.slots[n:bucket].fill_(self.pad_slot)
            self.static.context_lens[n:bucket].fill_(1)
