"""One simulated worker of the routing simulator: an engine cost model, stepped by the event loop.

What it models, and how far:
- **prefix cache**: an LRU of block hashes with a fixed capacity (`cache_blocks`, the share of KV memory
  that holds cached prefixes). At admission a request takes the leading run of its blocks that the cache
  holds (at most `prompt - 1` tokens: the last token is always computed); when its prefill step ends all
  its full prompt blocks are stored and the least recently used ones beyond capacity are evicted. Each
  store/evict is reported to `on_kv_event`, as the worker's KV events stream would. Blocks in use by a
  running sequence are not pinned (a simplification: it only affects later requests). With
  `EngineModel.shared_kv` the worker's own scheduler and one pool of KV blocks take the place of this
  cache and of the batching below (`loadtest.sim_paged`).
- **adapters**: `max_loras` device slots (LRU) and a host tier of `host_adapters` (LRU; an adapter on the
  device stays in host memory; `loadtest.sim_adapters`). A request whose adapter is not on the device
  needs a slot not used by any running sequence; if none is free it waits (and later requests may pass
  it, as in vLLM's scheduler). Loads cost `disk_load_s` (not in host memory) or `host_load_s` and stall
  the step.
- **continuous batching**: one step = the running sequences' decode step plus the prefill of newly
  admitted ones (up to `max_num_seqs` sequences and `max_prefill_tokens` uncached prompt tokens per
  step). Step time = adapter loads + uncached prefill tokens / `prefill_tok_s` + (if any sequence is
  decoding) `decode_step_s + decode_step_per_seq_s × running`. A prefilled request's first token comes at
  the end of its prefill step, so TTFT = queue wait + adapter load + uncached prefill (+ the decode step
  it shares).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtest.sim_adapters import AdapterTiers
from loadtest.sim_workload import BLOCK_SIZE, SimRequest
from loragate.messages import WorkerState

KvEvent = Callable[[str, Sequence[int], Sequence[int]], None]  # (worker id, stored, evicted)


@dataclass(frozen=True, slots=True)
class EngineModel:
    cache_blocks: int = 2048  # prefix-cache capacity in blocks of 16 tokens
    kv_blocks: int = 4096  # published as kv_blocks_total; free = total - blocks of running sequences
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048
    max_loras: int = 32
    host_adapters: int = 64
    disk_load_s: float = 0.050
    host_load_s: float = 0.005
    prefill_tok_s: float = 10_000.0
    decode_step_s: float = 0.020
    decode_step_per_seq_s: float = 0.0003
    # One pool of `kv_blocks` for running sequences and cached prefixes, batched by the worker's own
    # scheduler and block manager (`loadtest.sim_paged`), instead of a fixed `cache_blocks` beside them.
    shared_kv: bool = False

    def __post_init__(self) -> None:
        if self.host_adapters < self.max_loras:
            raise ValueError("host_adapters must be at least max_loras (device adapters stay in host memory)")

    def saturation_rps(self, prompt_tokens: float, output_tokens: float) -> float:
        """Requests/s one worker completes with full batches, no cache hits and no adapter loads."""
        decode = output_tokens * (self.decode_step_s / self.max_num_seqs + self.decode_step_per_seq_s)
        return 1.0 / (decode + prompt_tokens / self.prefill_tok_s)


@dataclass(slots=True)
class SimSeq:
    request: SimRequest
    cached_tokens: int = 0
    generated: int = 0


@dataclass(slots=True)
class WorkerStats:
    """Figures of the measured requests (arrived at or after `measure_from_s`); loads count against the
    request that needed them."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    disk_loads: int = 0
    host_loads: int = 0
    served: int = 0  # requests finished
    tokens: int = 0  # prompt + output tokens of finished requests
    ttft_s: list[float] = field(default_factory=list)
    steps: int = 0
    batch_sum: int = 0  # Σ running sequences over steps, for the mean batch size


class SimWorkerBase(ABC):
    """What every simulated worker shares: its identity, adapter tiers (`loadtest.sim_adapters`),
    measured figures and heartbeat. Batching and the prefix cache are the subclass's: `SimWorker` (a fixed
    prefix cache beside the batch) or `loadtest.sim_paged.PagedSimWorker` (the worker's own scheduler)."""

    def __init__(
        self,
        worker_id: str,
        model: EngineModel,
        base: str,
        on_kv_event: KvEvent | None = None,
        measure_from_s: float = 0.0,
    ):
        self.worker_id, self.model, self.base = worker_id, model, base
        self.on_kv_event = on_kv_event
        self.measure_from_s = measure_from_s  # requests arriving earlier are warm-up: not counted
        self.tiers = AdapterTiers(model.max_loras, model.host_adapters)
        self.admitted: list[SimSeq] = []  # requests whose first token the current step samples
        self.busy = False
        self.stats = WorkerStats()
        self._rate_window: deque[tuple[float, int]] = deque()  # (time, output tokens so far)
        self._output_tokens = 0
        self._setup()

    @abstractmethod
    def _setup(self) -> None:
        """The subclass's own state: its batch and prefix cache (called last by `__init__`)."""

    @property
    @abstractmethod
    def outstanding(self) -> int:
        """Requests enqueued and not finished (what the real worker's queue length counts)."""

    @abstractmethod
    def cached_run(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the prefix cache holds."""

    @abstractmethod
    def enqueue(self, request: SimRequest) -> None: ...

    @abstractmethod
    def start_step(self) -> float | None:
        """Admit what fits and return the step's duration; None when there is nothing to run."""

    @abstractmethod
    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the step's outputs at `now`; returns the requests that finished."""

    @abstractmethod
    def kv_blocks_free(self) -> int: ...

    @abstractmethod
    def num_running(self) -> int: ...

    @abstractmethod
    def num_waiting(self) -> int: ...

    def measured(self, request: SimRequest) -> bool:
        return request.arrival_s >= self.measure_from_s

    def _acquire_adapter(self, request: SimRequest, in_use: set[str | None]) -> float | None:
        """Seconds to make the request's adapter device-resident (0 if it is); None when no slot is free."""
        if request.adapter is None:
            return 0.0
        source = self.tiers.acquire(request.adapter, in_use)
        if source == "host":
            self.stats.host_loads += self.measured(request)
            return self.model.host_load_s
        if source == "disk":
            self.stats.disk_loads += self.measured(request)
            return self.model.disk_load_s
        return None if source is None else 0.0

    # -- heartbeat --------------------------------------------------------------------------------
    def state(self, now: float) -> WorkerState:
        """The heartbeat a real worker would publish now (`updated_at` in simulated seconds)."""
        self._rate_window.append((now, self._output_tokens))
        while now - self._rate_window[0][0] > 10.0:
            self._rate_window.popleft()
        (since, n0) = self._rate_window[0]
        span = now - since
        return WorkerState(
            worker_id=self.worker_id,
            model=self.base,
            model_dir="",
            max_model_len=4096,
            adapters_device=tuple(self.tiers.device),
            adapters_host=tuple(self.tiers.host),
            kv_blocks_free=self.kv_blocks_free(),
            kv_blocks_total=self.model.kv_blocks,
            block_size=BLOCK_SIZE,
            running=self.num_running(),
            waiting=self.num_waiting(),
            max_adapters=self.model.max_loras,
            decode_tok_s=round((self._output_tokens - n0) / span, 1) if span > 0 else 0.0,
            prefill_tok_s=self.model.prefill_tok_s,
            updated_at=now,
        )


class SimWorker(SimWorkerBase):
    """Continuous batching with a fixed-size prefix cache beside the batch (see the module docstring)."""

    def _setup(self) -> None:
        self.cache: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []

    def cached_run(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.admitted) + len(self.running)

    def enqueue(self, request: SimRequest) -> None:
        self.waiting.append(SimSeq(request))

    # -- one step ---------------------------------------------------------------------------------
    def start_step(self) -> float | None:
        load_s, prefill_tokens = 0.0, 0
        in_use = {s.request.adapter for s in self.running}
        skipped: list[SimSeq] = []
        while self.waiting and len(self.running) + len(self.admitted) < self.model.max_num_seqs:
            seq = self.waiting[0]
            uncached = self._uncached_tokens(seq.request)
            if self.admitted and prefill_tokens + uncached > self.model.max_prefill_tokens:
                break
            self.waiting.popleft()
            adapter_s = self._acquire_adapter(seq.request, in_use)
            if adapter_s is None:
                skipped.append(seq)
                continue
            in_use.add(seq.request.adapter)
            load_s += adapter_s
            seq.cached_tokens = self._take_prefix(seq.request)
            prefill_tokens += seq.request.prompt_tokens - seq.cached_tokens
            self.admitted.append(seq)
        self.waiting.extendleft(reversed(skipped))
        if not self.admitted and not self.running:
            return None
        decode_s = 0.0
        if self.running:
            decode_s = self.model.decode_step_s + self.model.decode_step_per_seq_s * len(self.running)
        self.busy = True
        return load_s + prefill_tokens / self.model.prefill_tok_s + decode_s

    def finish_step(self, now: float) -> list[SimRequest]:
        self.busy = False
        if now >= self.measure_from_s:
            self.stats.steps += 1
            self.stats.batch_sum += len(self.running) + len(self.admitted)
        for seq in self.running:
            seq.generated += 1
        self._output_tokens += len(self.running) + len(self.admitted)
        for seq in self.admitted:
            seq.generated = 1
            if self.measured(seq.request):
                self.stats.ttft_s.append(now - seq.request.arrival_s)
            self._store(seq.request.block_hashes)
        self.running.extend(self.admitted)
        self.admitted = []
        done = [s for s in self.running if s.generated >= s.request.output_tokens]
        if done:
            self.running = [s for s in self.running if s.generated < s.request.output_tokens]
        for seq in done:
            if self.measured(seq.request):
                self.stats.served += 1
                self.stats.tokens += seq.request.prompt_tokens + seq.request.output_tokens
        return [s.request for s in done]

    # -- prefix cache -----------------------------------------------------------------------------
    def _uncached_tokens(self, request: SimRequest) -> int:
        hit = min(self.cached_run(request.block_hashes) * BLOCK_SIZE, request.prompt_tokens - 1)
        return request.prompt_tokens - hit

    def _take_prefix(self, request: SimRequest) -> int:
        run = self.cached_run(request.block_hashes)
        for h in request.block_hashes[:run]:
            self.cache.move_to_end(h)
        hit = min(run * BLOCK_SIZE, request.prompt_tokens - 1)
        if self.measured(request):
            self.stats.prompt_tokens += request.prompt_tokens
            self.stats.cached_tokens += hit
        return hit

    def _store(self, hashes: Sequence[int]) -> None:
        stored: list[int] = []
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        evicted = []
        while len(self.cache) > self.model.cache_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        if self.on_kv_event is not None and (stored or evicted):
            self.on_kv_event(self.worker_id, stored, evicted)

    def kv_blocks_free(self) -> int:
        """KV blocks not held by a running sequence (the cache's own are free: evictable)."""
        used = sum(
            -(-(s.request.prompt_tokens + s.generated) // BLOCK_SIZE) for s in (*self.running, *self.admitted)
        )
        return max(0, self.model.kv_blocks - used)

    def num_running(self) -> int:
        return len(self.running) + len(self.admitted)

    def num_waiting(self) -> int:
        return len(self.waiting)
