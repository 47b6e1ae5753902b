"""Synthetic serving workloads: shared system prompts, Zipf adapter popularity, mixed lengths.

Deterministic for a seed. Prompts are token ids (the engine benchmarks skip tokenization); a request
picks a system prompt (Zipf over `num_system_prompts`), then a private suffix up to its sampled length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from loragate.types import Request, SamplingParams


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 128
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (64, 256)
    num_system_prompts: int = 4
    system_len: tuple[int, int] = (16, 96)
    base_fraction: float = 0.15  # requests with no adapter
    zipf_s: float = 1.1
    seed: int = 0
    min_token_id: int = 8  # keep clear of special tokens


def zipf_choice(rng: random.Random, items: list[str], s: float) -> str:
    weights = [1.0 / (rank + 1) ** s for rank in range(len(items))]
    return rng.choices(items, weights=weights)[0]


def make_workload(spec: WorkloadSpec, vocab_size: int, adapters: list[str]) -> list[Request]:
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(spec.min_token_id, vocab_size) for _ in range(n)]

    systems = [tokens(rng.randint(*spec.system_len)) for _ in range(spec.num_system_prompts)]
    system_ids = [str(i) for i in range(len(systems))]
    requests = []
    for i in range(spec.num_requests):
        system = systems[int(zipf_choice(rng, system_ids, spec.zipf_s))]
        length = max(rng.randint(*spec.prompt_len), len(system) + 1)
        prompt = system + tokens(length - len(system))
        adapter = (
            None
            if not adapters or rng.random() < spec.base_fraction
            else zipf_choice(rng, adapters, spec.zipf_s)
        )
        params = SamplingParams(max_tokens=rng.randint(*spec.output_len), ignore_eos=True)
        requests.append(Request(f"req-{i}", tuple(prompt), params, adapter))
    return requests


def capped(requests: list[Request], max_tokens: int | None) -> list[Request]:
    """`requests` with each one's output tokens capped at `max_tokens` (None: as they are); a benchmark's
    `--max-tokens`, for quick runs and tests: the same prompts, adapters and order, less decoding."""
    if max_tokens is None:
        return requests
    return [
        replace(r, params=replace(r.params, max_tokens=min(max_tokens, r.params.max_tokens)))
        for r in requests
    ]
