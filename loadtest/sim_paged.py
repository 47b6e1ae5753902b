"""A simulated worker whose batching and KV cache are the real worker's (`EngineModel.shared_kv`).

`loadtest.sim_worker.SimWorker` models a prefix cache of fixed size beside the running sequences. A real
worker has one pool of KV blocks: running sequences take theirs from it, and what they free stays cached
(LRU by the time it was freed) until a new allocation needs the block. So under load the cache shrinks,
a finished request's output blocks sit in it until they are evicted, requests wait for KV to free up,
and a sequence that cannot grow is preempted. Rather than model all that, this worker steps the
engine's own `worker.scheduler.Scheduler` over its own `worker.block_manager.BlockManager` with real
`worker.sequence.Sequence`s: admission, chunked prefill, preemption, prefix hits (`cached_tokens` as the
real worker reports them), KV events and the free-block count a heartbeat publishes are the worker's.
What stays modelled: a step's duration (the `EngineModel` costs), the adapter tiers (`SimWorkerBase`'s), and
the sampled tokens (ids no prompt holds, so output blocks are never hit, as with real outputs).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from loadtest.sim_worker import SimSeq, SimWorkerBase
from loadtest.sim_workload import BLOCK_SIZE, SimRequest
from loragate.types import Request, SamplingParams
from worker.block_manager import BlockManager
from worker.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from worker.sequence import Sequence

OUTPUT_TOKEN_BASE = 1 << 40  # sampled token ids: above any vocabulary, unique per worker


class PagedSimWorker(SimWorkerBase):
    def _setup(self) -> None:
        model = self.model
        self.blocks = BlockManager(model.kv_blocks, BLOCK_SIZE)
        config = SchedulerConfig(model.max_num_seqs, model.max_prefill_tokens, model.max_loras)
        self.scheduler = Scheduler(config, self.blocks)
        self.live: dict[str, tuple[SimRequest, Sequence]] = {}
        self._plan: SchedulerOutput | None = None
        self._next_token = OUTPUT_TOKEN_BASE

    @property
    def outstanding(self) -> int:
        return len(self.live)

    def cached_run(self, hashes: Seq[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks.cached:
                break
            n += 1
        return n

    def enqueue(self, request: SimRequest) -> None:
        if len(request.prompt_token_ids) != request.prompt_tokens:
            raise ValueError(f"{request.request_id}: the paged worker needs the prompt's token ids")
        real = Request(
            request.request_id,
            request.prompt_token_ids,
            SamplingParams(max_tokens=request.output_tokens, temperature=0.0),
            request.adapter,
        )
        seq = Sequence.from_request(real)
        self.live[request.request_id] = (request, seq)
        self.scheduler.add(seq)

    # -- one step ---------------------------------------------------------------------------------
    def start_step(self) -> float | None:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        self._plan = plan
        load_s, prefill_tokens, decodes = 0.0, 0, 0
        in_use = {s.adapter for s in self.scheduler.running}
        ready: set[str | None] = set()  # the step's adapters made resident (each once)
        for seq, n in plan.scheduled:
            if seq.adapter not in ready:
                ready.add(seq.adapter)
                adapter_s = self._acquire_adapter(self.live[seq.request_id][0], in_use)
                if adapter_s is None:  # cannot happen: the scheduler runs at most max_loras adapters
                    raise RuntimeError(f"{self.worker_id}: no adapter slot for {seq.adapter}")
                load_s += adapter_s
            if seq.num_computed_tokens + n == seq.num_tokens and n == 1 and seq.num_output_tokens:
                decodes += 1
            else:
                prefill_tokens += n
        # Requests whose first token this step samples (the event loop reports them to routing).
        self.admitted = [
            SimSeq(self.live[seq.request_id][0])
            for seq, n in plan.scheduled
            if seq.num_computed_tokens + n == seq.num_tokens and seq.num_output_tokens == 0
        ]
        decode_s = self.model.decode_step_s + self.model.decode_step_per_seq_s * decodes if decodes else 0.0
        self.busy = True
        return load_s + prefill_tokens / self.model.prefill_tok_s + decode_s

    def finish_step(self, now: float) -> list[SimRequest]:
        self.busy = False
        plan, self._plan, self.admitted = self._plan, None, []
        assert plan is not None, "finish_step without start_step"
        if now >= self.measure_from_s:
            self.stats.steps += 1
            self.stats.batch_sum += len(plan.scheduled)
        done: list[SimRequest] = []
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
        for seq, _ in plan.scheduled:
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk short of the prompt's end: nothing sampled
            request = self.live[seq.request_id][0]
            if seq.num_output_tokens == 0 and self.measured(request):
                self.stats.ttft_s.append(now - request.arrival_s)
            seq.token_ids.append(self._next_token)
            self._next_token += 1
            self._output_tokens += 1
            if seq.num_output_tokens >= request.output_tokens:
                self.scheduler.remove(seq)
                del self.live[seq.request_id]
                if self.measured(request):
                    self.stats.served += 1
                    self.stats.tokens += request.prompt_tokens + request.output_tokens
                    self.stats.prompt_tokens += request.prompt_tokens
                    self.stats.cached_tokens += seq.num_cached_tokens
                done.append(request)
        stored, evicted = self.blocks.drain_events()
        if self.on_kv_event is not None and (stored or evicted):
            self.on_kv_event(self.worker_id, stored, evicted)
        return done

    # -- heartbeat figures --------------------------------------------------------------------------
    def kv_blocks_free(self) -> int:
        return self.blocks.num_free_blocks

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
