"""One small engine run whose tokens two kernel backends must agree on; `python -m` prints them as JSON.

The run covers what the kernels see in serving: mixed adapters and base requests in one batch (SGMV
segments, split-K shrink in decode), chunked prefill forced by a small token budget (prefill attending to
an earlier chunk), a context longer than one decode tile (split-KV decode and its merge), in a second
round a prefix-cache hit (prefill over cached blocks), and decode steps of three sequences with and
without adapters (with `--graphs`, a padded bucket of the decode graphs). Greedy, EOS ignored, fp32.

It comes in two parts, each on an engine of its own, that two processes can run at once (the interpreter
runs one core's Python): `first` (the first round) and `second` (the prefix-cache round, after a request
that caches the prefix, then the decode steps of three).

    TRITON_INTERPRET=1 LORAGATE_KERNEL_BACKEND=triton \
        python -m tests.worker.engine_scenario ZOO_ROOT --part first|second [--graphs]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

BASE = "tiny"
ADAPTERS = ("qv-r8", "all-r64", "mlp-r32", "kv-r32")
MAX_TOKENS = 4
PARTS = ("first", "second")


def _request(rid: str, prompt: list[int], adapter: str | None, max_tokens: int = MAX_TOKENS) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter)


def run_scenario(
    zoo: ZooPaths, part: str, dtype: torch.dtype = torch.float32, graphs: bool = False
) -> dict[str, Any]:
    """`{"tokens": {request id: ids}, "cached": {request id: cached prompt tokens}, ...}` of the run of
    `part` (one of `PARTS`); `graphs`: whole-decode steps through `worker.decode_graphs`' static buffers
    (uncaptured off a GPU)."""
    if part not in PARTS:
        raise ValueError(f"part: one of {PARTS}, not {part!r}")
    engine = LLMEngine(
        zoo.base(BASE),
        EngineConfig(
            dtype=dtype,
            adapters={n: zoo.adapter(BASE, n) for n in ADAPTERS},
            block_size=8,
            num_kv_blocks=48,
            max_num_batched_tokens=32,
            max_loras=4,
            max_num_seqs=6,  # decode buckets 1, 2, 4 and 6: the 4 requests pad to 4, 2 requests to 2
            max_model_len=96,
            cuda_graphs=graphs,
        ),
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(8, 8000) for _ in range(n)] for n in (9, 17, 23, 70)]
    adapters: list[str | None] = [ADAPTERS[0], None, ADAPTERS[1], ADAPTERS[2]]
    first = [_request(f"a{i}", p, a) for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]
    # a2's prompt and adapter, for the second part's prefix cache.
    warm = _request("w2", prompts[2], ADAPTERS[1])
    # Shares the first two blocks of a2's prompt and its adapter: a prefix-cache hit.
    again = _request("b0", prompts[2][:16] + [rng.randrange(8, 8000) for _ in range(5)], ADAPTERS[1])
    other = _request("b1", [rng.randrange(8, 8000) for _ in range(12)], ADAPTERS[3])
    base = _request("b2", [rng.randrange(8, 8000) for _ in range(7)], None)
    # Decode steps of three sequences: a bucket of 4 with a padding row, with adapters, then without; the
    # last after steps of four, whose last row's KV slot the padding row must not write into.
    plain = [
        _request(f"c{i}", [rng.randrange(8, 8000) for _ in range(5 + i)], None, 2 if i == 0 else MAX_TOKENS)
        for i in range(4)
    ]
    if part == "first":
        results = engine.generate(first)
    else:
        results = [*engine.generate([warm]), *engine.generate([again, other, base]), *engine.generate(plain)]
    triton = sorted(m for m in sys.modules if m.startswith("kernels.") and m.endswith("_triton"))
    return {
        "tokens": {r.request_id: r.token_ids for r in results},
        "cached": {r.request_id: r.cached_tokens for r in results},
        "triton_modules": triton,  # the Triton kernel modules that have been dispatched to
        "steps": engine.stats.steps,
        "graph_steps": engine.stats.graph_steps,
    }


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of the parts as one run of them all: their requests' tokens, modules and step counts."""
    return {
        "tokens": {k: v for run in runs for k, v in run["tokens"].items()},
        "cached": {k: v for run in runs for k, v in run["cached"].items()},
        "triton_modules": sorted({m for run in runs for m in run["triton_modules"]}),
        "steps": sum(run["steps"] for run in runs),
        "graph_steps": sum(run["graph_steps"] for run in runs),
    }


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m tests.worker.engine_scenario")
    cli.add_argument("zoo_root", type=Path)
    cli.add_argument("--part", choices=PARTS, required=True)
    cli.add_argument("--graphs", action="store_true")
    args = cli.parse_args()
    print(json.dumps(run_scenario(ZooPaths(args.zoo_root), args.part, graphs=args.graphs)))
