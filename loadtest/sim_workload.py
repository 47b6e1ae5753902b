"""The routing simulator's workload: Poisson arrivals of adapter requests on shared system prompts.

Each request has a tenant, an adapter (one of `num_adapters`, Zipf popularity; none for `base_fraction`
of requests), one of `num_system_prompts` system prompts (Zipf) of a few hundred tokens, a private user
suffix and an output length. Every adapter has a home system prompt (drawn once, Zipf): an adapter is
fine-tuned for one application, so with probability `system_affinity` its request uses that prompt, and
otherwise any (Zipf); 0 makes adapter and system prompt independent. Prompts are real token ids and
their block hashes come from `loragate.hashing.block_hashes`, so the prefix logic the simulator
exercises is the fleet's own (chained, adapter-keyed). Deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import accumulate

from loragate.hashing import block_hashes

BASE_MODEL = "sim-base"
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    tenant: str
    adapter: str | None  # adapter key "{base}:{name}"
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]  # full blocks of the prompt only
    prompt_token_ids: tuple[int, ...] = ()  # the prompt itself (to send it to a real fleet)


@dataclass(frozen=True, slots=True)
class SimWorkloadSpec:
    num_requests: int = 4000
    rate: float = 40.0  # requests per second, Poisson
    num_adapters: int = 200
    num_system_prompts: int = 40
    zipf_s: float = 1.1
    base_fraction: float = 0.15
    system_affinity: float = 0.8  # chance an adapter request uses its adapter's own system prompt
    num_tenants: int = 20
    system_len: tuple[int, int] = (200, 600)
    suffix_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (16, 256)
    vocab_size: int = 32_000
    seed: int = 0

    @property
    def mean_prompt_tokens(self) -> float:
        return (sum(self.system_len) + sum(self.suffix_len)) / 2

    @property
    def mean_output_tokens(self) -> float:
        return sum(self.output_len) / 2


def zipf_cum_weights(n: int, s: float) -> list[float]:
    return list(accumulate(1.0 / (rank + 1) ** s for rank in range(n)))


def adapter_key(index: int) -> str:
    return f"{BASE_MODEL}:lora-{index:03d}"


def make_sim_workload(spec: SimWorkloadSpec) -> list[SimRequest]:
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(8, spec.vocab_size) for _ in range(n)]

    systems = [tokens(rng.randint(*spec.system_len)) for _ in range(spec.num_system_prompts)]
    system_cum = zipf_cum_weights(spec.num_system_prompts, spec.zipf_s)
    adapter_cum = zipf_cum_weights(spec.num_adapters, spec.zipf_s)
    home = rng.choices(range(spec.num_system_prompts), cum_weights=system_cum, k=spec.num_adapters)
    prefix_hashes: dict[tuple[int, str | None], list[int]] = {}  # the system prompt's full blocks
    requests, now = [], 0.0
    for i in range(spec.num_requests):
        now += rng.expovariate(spec.rate)
        s = rng.choices(range(spec.num_system_prompts), cum_weights=system_cum)[0]
        if spec.num_adapters and rng.random() >= spec.base_fraction:
            a = rng.choices(range(spec.num_adapters), cum_weights=adapter_cum)[0]
            adapter, tenant = adapter_key(a), f"tenant-{a % spec.num_tenants}"
            if rng.random() < spec.system_affinity:
                s = home[a]
        else:
            adapter, tenant = None, f"tenant-{rng.randrange(spec.num_tenants)}"
        prompt = systems[s] + tokens(rng.randint(*spec.suffix_len))
        key = (s, adapter)
        if key not in prefix_hashes:
            prefix_hashes[key] = block_hashes(systems[s], BLOCK_SIZE, adapter)
        hashes = block_hashes(prompt, BLOCK_SIZE, adapter, start=prefix_hashes[key])
        requests.append(
            SimRequest(
                f"sim-{i}",
                tenant,
                adapter,
                now,
                len(prompt),
                rng.randint(*spec.output_len),
                tuple(hashes),
                tuple(prompt),
            )
        )
    return requests
