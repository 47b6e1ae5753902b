"""Continuous batching with a per-step token budget: running sequences first, then waiting ones.

Each step: every running sequence gets its next tokens in arrival order — one for a decode, a chunk for an
unfinished (chunked) prefill — while the budget lasts. When the KV pool cannot hold a sequence's next
tokens, the most recently arrived running sequence is preempted by recompute (blocks freed, KV recomputed
later; cached prefix blocks usually survive), so the step never fails and no request is lost. Only if no
preemption happened are waiting requests admitted, first come first served: the head takes its cached
prefix and a first chunk. A request whose adapter would exceed `max_loras` distinct adapters this step is
skipped so others can go ahead — but only `max_lora_skips` times in a row, after which admission stops
until it fits (no starvation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.block_manager import BlockManager
from worker.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_loras: int = 8
    max_lora_skips: int = 64


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.head_skips = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed, budget)
            if n == 0:
                kept.append(seq)
                continue
            while not self.blocks.can_append(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.blocks.append_slots(seq, n)
                out.scheduled.append((seq, n))
                kept.append(seq)
                budget -= n
        self.running = kept
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        adapters = {s.adapter for s in self.running if s.adapter is not None}
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if (
                seq.adapter is not None
                and seq.adapter not in adapters
                and len(adapters) >= self.config.max_loras
            ):
                if not skipped and self.head_skips >= self.config.max_lora_skips:
                    break  # the head has waited long enough: let running adapters drain
                skipped.append(self.waiting.popleft())
                continue
            if not seq.block_table:
                self.blocks.allocate_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.can_append(seq, n):
                self.blocks.free_seq(seq)
                break
            self.waiting.popleft()
            self.blocks.record_admission(seq)
            self.blocks.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
            if seq.adapter is not None:
                adapters.add(seq.adapter)
        self.head_skips = self.head_skips + 1 if skipped else 0
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
