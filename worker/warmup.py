"""Engine warm-up: the kernel variants that serving steps need, compiled before the first request.

On a GPU the first step of each new shape pays for compiling its Triton kernels (a second or so per
variant): without a warm-up the first minute of a fresh worker serves its users slowly, and the router
sees a worker that looks free but is not. The variants a step chooses depend only on a few coarse
facts about the batch (the row tile from tokens per LoRA segment, split-K from the number of programs,
the context tile from the longest context, prefill tiles from the chunk's token count, the dtype), and
the integers that take many values are not specialised on (`do_not_specialize` in `kernels/`), so a
ladder of synthetic batches covers them:

- decode batches of 1, 2, 4, ... up to `max_num_seqs` sequences,
- each with short, medium and long prompts (contexts of one, two and several KV blocks, prefill chunks of
  every tile size, long prompts split by the chunked-prefill budget),
- the second half of each batch added a step after the first, so steps mix decodes and prefill chunks,
- each without adapters, with one adapter and with several (long and short LoRA segments; the synthetic
  adapters alternate between all seven projections and q/v only, so every projection group, fused or
  single, runs with one and with several projections).

The batches run through the engine's own `step`, so sampling, logits processing and detokenizing warm up
too. The synthetic adapters are zero-valued, held in host memory only and never visible: afterwards the
engine's state is what a fresh engine holds (no requests, an empty prefix cache, no resident adapters,
zero counters, no events), with only the compiled kernels (and the allocator's cache) kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loragate.types import Request, SamplingParams
from worker.adapter_cache import AdapterPlan
from worker.lora import LoRAWeights, ModuleLoRA

if TYPE_CHECKING:
    from worker.engine import LLMEngine

WARMUP_PREFIX = "\x00warmup"  # no adapter or request id a client can give holds a NUL
PROMPT_BLOCKS = (0.75, 1.75, 5.5)  # prompt lengths, in KV blocks: contexts of one, two and several blocks
QV_ONLY = ("q_proj", "v_proj")
MAX_TOKENS = 3  # each request's output: a prefill, then decode steps


@dataclass(frozen=True)
class Wave:
    """One batch of the ladder: `seqs` requests of `prompt_len` tokens, `adapters` distinct adapters."""

    seqs: int
    prompt_len: int
    adapters: int


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    steps: int
    waves: int


def ladder(max_num_seqs: int, block_size: int, max_loras: int, max_model_len: int) -> list[Wave]:
    """The synthetic batches, smallest first."""
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    sizes.append(max_num_seqs)
    lens = sorted({max(1, min(int(b * block_size), max_model_len - MAX_TOKENS)) for b in PROMPT_BLOCKS})
    mixes = sorted({0, min(1, max_loras), min(8, max_loras)})
    return [Wave(s, p, a) for s in sizes for p in lens for a in mixes]


def synthetic_adapter(engine: LLMEngine, index: int) -> LoRAWeights:
    """A zero adapter of rank 8 (the kernels' tiles follow the slot stacks' largest rank, not the adapter's):
    on every projection (even index) or q/v only (odd)."""
    cfg, rank = engine.model_config, min(8, engine.config.max_lora_rank)
    cache = engine.adapters
    modules = {
        m: ModuleLoRA(
            a=torch.zeros(cfg.num_layers, rank, fan_in, dtype=cache.dtype),
            b=torch.zeros(cfg.num_layers, fan_out, rank, dtype=cache.dtype),
            scale=1.0,
        )
        for m, (fan_in, fan_out) in cfg.module_shapes().items()
        if index % 2 == 0 or m in QV_ONLY
    }
    return LoRAWeights(name=f"{WARMUP_PREFIX}-{index}", path=Path("/nonexistent"), modules=modules)


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Run the ladder on `engine` (which must hold no requests), then restore a fresh engine's state."""
    if engine.has_work():
        raise RuntimeError("warm_up needs an idle engine")
    start, steps = time.perf_counter(), 0
    cfg = engine.config
    # A prompt must fit the context and the KV pool (a small pool: short prompts only).
    limit = min(engine.max_model_len, engine.kv.num_blocks * cfg.block_size)
    waves = ladder(cfg.max_num_seqs, cfg.block_size, cfg.max_loras, limit)
    names = [_install(engine, synthetic_adapter(engine, i)) for i in range(max(w.adapters for w in waves))]
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    try:
        for w, wave in enumerate(waves):
            for i in range(wave.seqs):
                ids = torch.randint(0, vocab, (wave.prompt_len,), generator=generator).tolist()
                engine.add_request(
                    Request(
                        request_id=f"{WARMUP_PREFIX}-{w}-{i}",
                        prompt_token_ids=tuple(ids),
                        params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        adapter=names[i % wave.adapters] if wave.adapters else None,
                    )
                )
                if i == wave.seqs // 2 - 1:  # the second half's prefill steps carry the first's decodes
                    engine.step()
                    steps += 1
            while engine.has_work():
                engine.step()
                steps += 1
    finally:
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_work():
            engine.step()
        _forget(engine, names)
        engine.reset_state()
    if str(cfg.device).startswith("cuda"):
        torch.cuda.synchronize()
    return WarmupReport(time.perf_counter() - start, steps, len(waves))


def _install(engine: LLMEngine, weights: LoRAWeights) -> str:
    """Make `weights` servable by name from host memory (no file behind it)."""
    cache = engine.adapters
    cache.paths[weights.name] = weights.path
    cache.host[weights.name] = weights
    return weights.name


def _forget(engine: LLMEngine, names: list[str]) -> None:
    cache = engine.adapters
    resident = tuple((n, cache.device_lru[n]) for n in names if n in cache.device_lru)
    cache.apply(AdapterPlan(evict=resident, load=()))
    for name in names:
        cache.host.pop(name, None)
        cache.paths.pop(name, None)
