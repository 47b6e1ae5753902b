"""The engine: one loop of schedule → forward (paged KV, many adapters) → sample → postprocess.

A worker service drives it step by step (`add_request`, `step`, `abort`, `has_work`); `generate` runs a list
of requests offline to completion. A step samples after the request's logits processors
(`worker.logits_processors`: penalties, bias, min_tokens) and reports log-probabilities of the raw logits
(`worker.logprobs`) for the requests that ask. Everything a request can get wrong — unknown adapter, a
prompt too long for the context or the KV pool, token ids outside the vocabulary — fails in `add_request`,
never mid-step (the checks and each request's state: `worker.engine_requests`); a worker runs
`check_request` first and adds a guided request once its guide compiled on another thread (`add_request`'s
`grammar`). What the service publishes about the engine it reads through `info` (fixed facts), `snapshot()`
(load and cache counters), `drain_events()` / `state_events()` (KV and adapter events for the routers) and
the adapter methods below; the managers (`scheduler`, `blocks`, `adapters`, ...) are the engine's own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from loragate.contracts import AdapterTier, KVEvent
from loragate.types import FinishReason, Request, RequestOutput, TokenLogprob
from worker.adapter_cache import AdapterCache
from worker.batch import ForwardBatch, build_forward_batch
from worker.block_manager import BlockManager
from worker.config import EngineConfig, ModelLoadError
from worker.decode_graphs import DecodeGraphs, use_graphs
from worker.detokenizer import IncrementalDetokenizer
from worker.device import is_cuda
from worker.engine_events import EngineEvents
from worker.engine_requests import Tracked, check_request, request_output, track
from worker.engine_types import Completion, EngineInfo, EngineSnapshot, EngineStats
from worker.grammar import GuidedDecoding
from worker.host_memory import mapped_allocations
from worker.kv_cache import KVCache, bytes_per_block, kv_budget
from worker.loader import load_weights
from worker.logits_processors import needs_processing, process_logits
from worker.logprobs import gather_logprobs, read_step
from worker.model import LoRAContext, ModelRunner, pack_weights
from worker.models import load_model_config
from worker.sampler import Sampler
from worker.scheduler import Scheduler, SchedulerConfig
from worker.sequence import Sequence, SequenceStatus
from worker.warmup import WarmupReport, warm_up

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model_dir: Path | str, config: EngineConfig | None = None):
        self.model_dir = Path(model_dir)
        self.config = config = config or EngineConfig()
        self.model_config = cfg = load_model_config(self.model_dir)
        if is_cuda(config.device) and torch.device(config.device).index is not None:
            # Triton launches on the current device, torch allocates on the named one: make them agree.
            torch.cuda.set_device(torch.device(config.device))
        tok_path = self.model_dir / "tokenizer.json"
        if not tok_path.exists():
            raise ModelLoadError(f"{self.model_dir}: no tokenizer.json (a fast tokenizer is required)")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len)
        # Weights and KV pool in mappings of their own, returned whole when this engine goes; then every
        # step's large buffers reuse the last step's pages (`worker.host_memory`).
        with mapped_allocations():
            # First the weights, in their packed layout (widened bf16 ones take twice the memory,
            # `kernels.linear`): the KV pool may take a share of the memory left.
            weights = pack_weights(load_weights(self.model_dir, cfg, config.dtype, config.device))
            budget = kv_budget(
                cfg,
                config.kv_cache_bytes,
                config.max_num_seqs,
                self.max_model_len,
                config.dtype,
                config.device,
            )
            num_blocks = config.num_kv_blocks or max(
                1, budget // bytes_per_block(cfg, config.block_size, config.dtype)
            )
            graphs = use_graphs(config.cuda_graphs, weights.embed)
            self.kv = KVCache(
                cfg,
                num_blocks,
                config.block_size,
                config.dtype,
                config.device,
                int(graphs),
                config.kv_prefault,
            )
            self.runner = ModelRunner(cfg, weights, self.kv, self.max_model_len)
        self.adapters = AdapterCache(
            cfg,
            config.max_loras,
            config.max_lora_rank,
            config.host_adapter_bytes,
            config.dtype,
            config.device,
        )
        for name, path in config.adapters.items():
            self.adapters.register(name, Path(path))
        self.sampler = Sampler()
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.grammar = GuidedDecoding(self.model_dir, cfg.vocab_size, cfg.eos_token_ids, config.device)
        self.reset_state()
        self.info = EngineInfo(
            model_dir=self.model_dir,
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
            block_size=config.block_size,
            max_loras=config.max_loras,
            max_num_seqs=config.max_num_seqs,
            device=config.device,
            dtype=config.dtype,
        )
        self.warmup: WarmupReport | None = None
        self.graphs: DecodeGraphs | None = None
        if config.warmup or (config.warmup is None and is_cuda(config.device)):
            self.warmup = warm_up(self)
        if graphs:  # after the warm-up: its kernels are compiled, its state reset
            self.graphs = DecodeGraphs(
                self.runner, self.adapters, config.max_num_seqs, self.max_model_len, is_cuda(config.device)
            )
            try:
                self.graphs.capture_all()
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if config.cuda_graphs:  # asked for: a failure is the caller's to see
                    raise
                log.warning("CUDA graph capture failed, decode steps run eagerly: %s", e)
                self.graphs = None

    def reset_state(self) -> None:
        """A fresh engine's state (after `worker.warmup`): no requests, an empty prefix cache, zero counters
        and no pending events; the adapter cache keeps what it holds, its counters zeroed."""
        config = self.config
        self.blocks = BlockManager(self.kv.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, config.max_loras, config.max_lora_skips
            ),
            self.blocks,
        )
        self.adapters.reset_counters()
        self.requests: dict[str, Tracked] = {}
        self.aborted: list[Tracked] = []
        self.stats = EngineStats()
        self.events = EngineEvents(self.blocks, self.adapters)
        self._last_snapshot = self.snapshot()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request, grammar: CompiledGrammar | None = None) -> None:
        """Add `request` (ValueError, saying why, if it cannot run). A guided request's `grammar` is its
        guide compiled by `grammar.compile` (a worker does it off this thread); compiled now if not given."""
        self.check_request(request)
        matcher = self.grammar.start(request, grammar)  # ValueError if its guide cannot be honoured
        tracked = self.requests[request.request_id] = track(
            request, self.detokenizer, self.config.device, matcher
        )
        self.scheduler.add(tracked.seq)

    def check_request(self, request: Request) -> None:
        """`add_request`'s checks but its guide's (ValueError, saying why, if `request` cannot run); its
        adapter is read into host memory if it is not there."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_request(request, self.info, self.blocks.num_blocks)
        if request.adapter is not None:
            if not self.adapters.known(request.adapter):
                raise ValueError(f"unknown adapter {request.adapter!r}")
            self.adapters.ensure_host(request.adapter)  # reads and validates now, not mid-step

    def warm_grammar(self) -> None:
        """Load the structured-output engine now (seconds); meant for a background thread at start-up,
        and safe there: a guided request added meanwhile waits for it."""
        self.grammar.warm()

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV; its final output comes with the next `step`."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return False
        self.scheduler.remove(tracked.seq)
        tracked.seq.status = SequenceStatus.FINISHED
        tracked.seq.finish_reason = FinishReason.ABORT
        self.aborted.append(tracked)
        return True

    def has_work(self) -> bool:
        """True while a request is unfinished or an abort's final output has not yet been returned."""
        return bool(self.requests or self.aborted)

    @property
    def num_waiting(self) -> int:
        """Requests added but not yet admitted to the running batch (or preempted back out of it)."""
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        self._last_snapshot = self.snapshot()
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs = [request_output(t, [], "") for t in self.aborted]
        self.aborted.clear()
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if sched.is_empty:
            return outputs
        self.stats.steps += 1
        batch, order, sampled_seqs = self._prepare(sched.scheduled)
        tracked = [self.requests[s.request_id] for s in sampled_seqs]
        if self.graphs is not None and self.graphs.fits(batch, len(sampled_seqs)):
            self.stats.graph_steps += 1
            logits = self.graphs.run(batch)
        elif self._plain_greedy(batch, tracked):  # the greedy pick fused into the LM head: no logits
            self.stats.fused_greedy_steps += 1
            tokens = self.runner.greedy_tokens(batch, self._lora_context(batch))
            logits = None
        else:  # sampled rows, then prompt-logprob rows
            logits = self.runner.forward(batch, self._lora_context(batch))
        if logits is not None:
            raw = logits[: len(sampled_seqs)]
            # Penalties and bias first, then the guides' masks (a bias cannot lift a token a grammar forbids).
            processed = self.grammar.mask(
                process_logits(raw, sampled_seqs, self.model_config.eos_token_ids), tracked
            )
            tokens = self.sampler.select(
                processed, [s.request.params for s in sampled_seqs], [t.generator for t in tracked]
            )
        pending = None if logits is None else gather_logprobs(logits, tokens, sampled_seqs, batch.prompt_rows)
        token_ids, logprobs, prompt_logprobs = read_step(tokens, pending)
        for seq, n in order:
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
        for rows, entries in prompt_logprobs:
            self.requests[rows.seq.request_id].prompt_logprobs.extend(entries)
            rows.seq.next_prompt_logit = rows.first + rows.count
        for t, token, logprob in zip(tracked, token_ids, logprobs, strict=True):
            outputs.append(self._append_token(t, token, logprob))
        return outputs

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to completion (offline); results in the order given."""
        for r in requests:
            self.add_request(r)
        done: dict[str, Completion] = {}
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        while self.has_work():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.text_delta)
                if out.finished:
                    assert out.finish_reason is not None
                    done[out.request_id] = Completion(
                        out.request_id,
                        tokens[out.request_id],
                        "".join(texts[out.request_id]),
                        out.finish_reason,
                        out.prompt_tokens,
                        out.cached_tokens,
                    )
        return [done[r.request_id] for r in requests]

    # -- adapters -------------------------------------------------------------------------------
    def register_adapter(self, name: str, path: Path | str) -> None:
        """Make adapter `name` servable from `path` (read lazily, on first use or `preload_adapter`)."""
        self.adapters.register(name, Path(path))

    def adapter_path(self, name: str) -> Path | None:
        """Where adapter `name` is registered from, or None if it is unknown."""
        return self.adapters.paths.get(name)

    def adapter_tier(self, name: str) -> AdapterTier:
        return self.adapters.tier(name)

    def preload_adapter(self, name: str) -> None:
        """Read adapter `name` into host memory now (validating it), so its first request need not."""
        self.adapters.ensure_host(name)

    def pin_adapters(self, names: set[str]) -> None:
        """Adapters to evict from a tier only when nothing else can make room (replaces the last set)."""
        self.adapters.pinned = set(names)

    # -- state, for heartbeats, metrics and routers -------------------------------------------------
    @property
    def last_snapshot(self) -> EngineSnapshot:
        """The snapshot taken at the end of the last step: for other threads (the metrics server), which
        must not walk the engine's containers while its thread changes them; reading it is one reference."""
        return self._last_snapshot

    def snapshot(self) -> EngineSnapshot:
        """The engine's load and cache counters now; call it from the engine's thread only."""
        blocks, adapters, stats = self.blocks, self.adapters, self.stats
        return EngineSnapshot(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_free=blocks.num_free_blocks,
            kv_blocks_total=blocks.num_blocks,
            cached_blocks=len(blocks.cached),
            adapters_device=tuple(adapters.device_lru),
            adapters_host=tuple(adapters.host),
            prefix_hit_tokens=blocks.hit_tokens,
            prefix_queried_tokens=blocks.queried_tokens,
            adapter_disk_reads=adapters.disk_reads,
            adapter_device_loads=adapters.device_loads,
            adapter_device_evictions=adapters.device_evictions,
            adapter_host_evictions=adapters.host_evictions,
            steps=stats.steps,
            graph_steps=stats.graph_steps,
            preemptions=stats.preemptions,
            generated_tokens=stats.decode_tokens,
        )

    def drain_events(self) -> list[KVEvent]:
        """KV blocks stored / evicted and adapters moved between tiers since the last call."""
        return self.events.drain()

    def state_events(self) -> list[KVEvent]:
        """All the engine holds, as "cleared" then stored blocks and resident adapters (after a restart or
        an outage); the changes not yet drained are dropped, as this description covers them."""
        return self.events.state()

    # -- internals ------------------------------------------------------------------------------
    def _prepare(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[ForwardBatch, list[tuple[Sequence, int]], list[Sequence]]:
        """The step's adapters made resident and its batch laid out on the device."""
        slots = self.adapters.acquire({s.adapter for s, _ in scheduled if s.adapter is not None})
        for seq, _ in scheduled:
            seq.lora_slot = slots[seq.adapter] if seq.adapter is not None else -1
        return build_forward_batch(scheduled, self.config.block_size, self.config.device)

    def _plain_greedy(self, batch: ForwardBatch, tracked: list[Tracked]) -> bool:
        """Whether this step needs nothing of its logits but each row's argmax, and the LM head can give
        that without them (`kernels.lm_head`): every row greedy, unprocessed, unguided, no logprobs."""
        if batch.prompt_rows or not self.runner.fuses_greedy:
            return False
        eos = self.model_config.eos_token_ids
        return all(
            t.seq.request.params.greedy
            and t.seq.request.params.logprobs is None
            and t.matcher is None
            and not needs_processing(t.seq, eos)
            for t in tracked
        )

    def _lora_context(self, batch: ForwardBatch) -> LoRAContext | None:
        """An eager step's adapter stacks and per-module segment metadata (None: no token is adapted)."""
        if batch.lora is None:
            return None
        meta, cache = batch.lora, self.adapters
        metas = {
            m: meta.for_module(cache.host_ranks[m], cache.host_scale[m])
            for m in cache.active_modules(meta.active_slots)
        }
        return LoRAContext(cache.stacks, metas)

    def _append_token(self, t: Tracked, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq, p = t.seq, t.seq.request.params
        seq.token_ids.append(token)
        self.stats.decode_tokens += 1
        reason: FinishReason | None = None
        eos = not p.ignore_eos and token in self.model_config.eos_token_ids
        stop_token = eos or token in t.stop_token_ids
        # Before min_tokens no stop string ends the request (vLLM's rule; stop tokens cannot be sampled).
        stops = seq.num_output_tokens >= p.min_tokens
        # A stop token ends the request without adding its text; otherwise decode and look for stop strings.
        # A guided request also ends once its grammar allows nothing but a stop token.
        if (
            stop_token
            or self.detokenizer.update(t.detok, seq.output_token_ids, stops)
            or self.grammar.accept(t, token)
        ):
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            seq.finish_reason = reason
            seq.status = SequenceStatus.FINISHED
            self.scheduler.remove(seq)
            del self.requests[seq.request_id]
            self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        delta = self.detokenizer.delta(t.detok, reason is not None)
        return request_output(t, [token], delta, () if logprob is None else (logprob,))
