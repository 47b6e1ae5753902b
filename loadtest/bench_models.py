"""The models and workloads the engine benchmarks run: the zoo's random-weight models, and the real
SmolLM2-135M-Instruct with adapters shaped like the ones issue 15 measured against vLLM.

SmolLM2's adapters: 8 LoRA adapters of ranks 8 and 16, half on all seven projections and half on q/v only,
built once with the zoo's adapter builder (fixed seeds, real PEFT checkpoints) into the loragate cache, keyed
by `SMOLLM2_ADAPTERS_VERSION`. Its workload: 128 requests, prompts 20–200 tokens, about 16,100 output tokens.
The zoo models keep the workload their earlier figures were measured on.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from loadtest.workload import WorkloadSpec
from loragate.paths import cache_dir
from loragate.types import Request
from worker.device import dtype_name
from worker.hub.pull import ensure_model
from worker.modelzoo.adapters import ALL_LINEAR, AdapterSpec, build_adapter
from worker.modelzoo.make import ensure_zoo

SMOLLM2_ADAPTERS_VERSION = 1
QV = ("q_proj", "v_proj")
SMOLLM2_ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("all-r8-1", 8, 16, ALL_LINEAR, seed=101, strength=0.05),
    AdapterSpec("all-r8-2", 8, 16, ALL_LINEAR, seed=102, strength=0.05),
    AdapterSpec("all-r16-1", 16, 32, ALL_LINEAR, seed=103, strength=0.05),
    AdapterSpec("all-r16-2", 16, 32, ALL_LINEAR, seed=104, strength=0.05),
    AdapterSpec("qv-r8-1", 8, 16, QV, seed=105, strength=0.08),
    AdapterSpec("qv-r8-2", 8, 16, QV, seed=106, strength=0.08),
    AdapterSpec("qv-r16-1", 16, 32, QV, seed=107, strength=0.08),
    AdapterSpec("qv-r16-2", 16, 32, QV, seed=108, strength=0.08),
)
SMOLLM2_WORKLOAD = WorkloadSpec(prompt_len=(20, 200), output_len=(64, 188), system_len=(16, 64))


@dataclass(frozen=True)
class BenchModel:
    model_dir: Path
    adapters: dict[str, Path]  # name -> PEFT checkpoint
    workload: WorkloadSpec


def bench_model(name: str, num_adapters: int, num_requests: int) -> BenchModel:
    """`name`'s checkpoint, adapters and workload (`num_adapters` names for a zoo model: its adapters
    reused under distinct names, as distinct adapters would be, with distinct ids, slots and loads)."""
    if name == "smollm2":
        workload = WorkloadSpec(**{**SMOLLM2_WORKLOAD.__dict__, "num_requests": num_requests})
        model_dir = ensure_model("smollm2")
        return BenchModel(model_dir, smollm2_adapters(model_dir), workload)
    zoo = ensure_zoo()
    names = zoo.adapter_names(name)
    adapters = {
        f"{names[i % len(names)]}-{i}": zoo.adapter(name, names[i % len(names)]) for i in range(num_adapters)
    }
    return BenchModel(zoo.base(name), adapters, WorkloadSpec(num_requests=num_requests))


def smollm2_adapters(model_dir: Path) -> dict[str, Path]:
    """SmolLM2's benchmark adapters, built on first use."""
    root = cache_dir() / "bench" / f"smollm2-adapters-v{SMOLLM2_ADAPTERS_VERSION}"
    paths = {spec.name: root / spec.name for spec in SMOLLM2_ADAPTERS}
    missing = [s for s in SMOLLM2_ADAPTERS if not (paths[s.name] / "adapter_model.safetensors").exists()]
    if missing:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir))
        for spec in tqdm(missing, desc="SmolLM2 bench adapters", file=sys.stderr):
            build_adapter(base, "smollm2", spec, paths[spec.name])
    return paths


def run_header(model: str, device: str, dtype: torch.dtype, requests: list[Request]) -> dict[str, object]:
    """The keys every engine benchmark's JSON line starts with: what ran, where, on how much work."""
    return {
        "model": model,
        "device": device,
        "dtype": dtype_name(dtype),
        "requests": len(requests),
        "output_tokens": sum(r.params.max_tokens for r in requests),
    }
