"""What crosses the engine's boundary: its fixed facts, a snapshot of its load, and a finished request.

The worker service and its helpers (heartbeat, metrics, KV-event log, adapter registry) read the engine
only through these frozen values and `LLMEngine`'s public methods, never through its managers, so the
engine can change how it schedules, caches and loads without them noticing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from loragate.types import FinishReason


@dataclass(frozen=True)
class Completion:
    """The final result of one request, from `generate`."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves and how it is shaped; fixed when it starts."""

    model_dir: Path
    max_model_len: int
    vocab_size: int
    block_size: int
    max_loras: int
    max_num_seqs: int
    device: str
    dtype: torch.dtype


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load and cache contents at one moment (between steps), as heartbeats and metrics
    publish them. Counters (`prefix_*`, `adapter_*`, `steps`, `preemptions`, `generated_tokens`) only
    grow over the engine's life."""

    running: int  # sequences being computed
    waiting: int  # added, not yet admitted (or preempted)
    kv_blocks_free: int  # free KV blocks, cached-but-unreferenced ones included
    kv_blocks_total: int
    cached_blocks: int  # blocks in the prefix cache (referenced or not)
    adapters_device: tuple[str, ...]  # in device slots, least recently used first
    adapters_host: tuple[str, ...]  # in host memory (a device-resident adapter usually is too)
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache
    prefix_queried_tokens: int  # prompt tokens looked up in it
    adapter_disk_reads: int  # host misses: adapter read from disk
    adapter_device_loads: int  # adapter copied from host into a device slot
    adapter_device_evictions: int
    adapter_host_evictions: int
    steps: int
    graph_steps: int  # of `steps`, those replayed from a CUDA graph
    preemptions: int
    generated_tokens: int


@dataclass
class EngineStats:
    """The engine's own counters (mutable, owned by the engine; read them through `snapshot`)."""

    steps: int = 0
    graph_steps: int = 0  # of `steps`, those replayed from a CUDA graph (`worker.decode_graphs`)
    fused_greedy_steps: int = 0  # of `steps`, those whose greedy picks came from the LM head (no logits)
    decode_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
