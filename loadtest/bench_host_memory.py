"""What keeping freed host memory (`worker.host_memory`) does to an engine's steps, side by side.

malloc's settings belong to a process, so each run is a child process with a fresh engine: `kept` (the
engine's default) or `default` (`LORAGATE_KEEP_FREED_MEMORY=0`: glibc's own settings), alternated
`--rounds` times each so the machine's drift hits both alike. A child times, after one untimed step of
each kind:
  - prefill steps: each prefills `--tokens` fresh tokens (16 prompts, no prefix-cache hits), median ms and
    page faults per step;
  - decode steps: `--decode-seqs` sequences of 32-token prompts, one token each per step (logits of
    `--decode-seqs` × vocabulary), median ms and page faults per step;
and reports its peak resident size. Figures: the median child of each mode.

    python -m loadtest.bench_host_memory [--model tiny|small|smollm2] [--tokens 8192] [--decode-seqs 128]
        [--rounds 3] [--steps 4] [--device auto|cpu|cuda[:N]] [--dtype auto|float32|bfloat16]

The last line printed is one JSON object: `kept_prefill_ms`, `default_prefill_ms`, `prefill_speedup`
(default / kept), `kept_prefill_faults`, `default_prefill_faults`, the same for decode, `kept_maxrss_mb`,
`default_maxrss_mb`, and the workload (and `*_prefill_faults_last`, the last timed prefill step's: kept
buffers settle over the first steps, as the heap finds room for each size).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from worker.device import add_device_args, device_args
from worker.host_memory import ENV

MODES = {"kept": {}, "default": {ENV: "0"}}
PROMPTS = 16
DECODE_PROMPT = 32


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_host_memory", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="tiny", help="tiny | small | smollm2 (loadtest.bench_models)")
    p.add_argument("--tokens", type=int, default=8192, help="fresh tokens a timed prefill step computes")
    p.add_argument("--decode-seqs", type=int, default=128, help="sequences of a timed decode step")
    p.add_argument("--rounds", type=int, default=3, help="children of each mode, alternated")
    p.add_argument("--steps", type=int, default=4, help="timed steps of each kind per child")
    p.add_argument("--child", help=argparse.SUPPRESS)  # the model's directory: this process is a child
    add_device_args(p)
    return p


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One engine's figures (in this process, with whatever malloc settings its environment asks)."""
    from loragate.types import Request, SamplingParams
    from worker.config import EngineConfig
    from worker.engine import LLMEngine

    device, dtype = device_args(build_parser(), args)
    per_prompt = args.tokens // PROMPTS
    blocks = (max(args.tokens, args.decode_seqs * (DECODE_PROMPT + 2 * args.steps + 4)) // 16 + 64) * 2
    config = EngineConfig(
        device=device, dtype=dtype, num_kv_blocks=blocks, max_num_batched_tokens=max(args.tokens, 2048),
        max_num_seqs=max(128, args.decode_seqs), enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(args.child, config)
    rng = random.Random(0)
    vocab = engine.info.vocab_size

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(8, vocab) for _ in range(n))

    def timed_step() -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        return elapsed * 1000, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    prefill: list[tuple[float, int]] = []
    for k in range(args.steps + 1):
        for i in range(PROMPTS):
            engine.add_request(Request(f"p{k}-{i}", prompt(per_prompt), SamplingParams(max_tokens=1)))
        prefill.append(timed_step())
        while engine.has_work():
            engine.step()
    params = SamplingParams(max_tokens=args.steps + 3, ignore_eos=True)
    for i in range(args.decode_seqs):
        engine.add_request(Request(f"d{i}", prompt(DECODE_PROMPT), params))
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # the prompts' prefill, not timed
    decode = [timed_step() for _ in range(args.steps + 1)]
    while engine.has_work():
        engine.step()
    return {
        "prefill_ms": statistics.median(t for t, _ in prefill[1:]),
        "prefill_faults": statistics.median(f for _, f in prefill[1:]),
        "prefill_faults_last": prefill[-1][1],
        "decode_ms": statistics.median(t for t, _ in decode[1:]),
        "decode_faults": statistics.median(f for _, f in decode[1:]),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_child(mode: str, argv: Sequence[str], model_dir: str) -> dict[str, Any]:
    env = {**os.environ, **MODES[mode]}
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_host_memory", *argv, "--child", model_dir],
        env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} child failed:\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from loadtest.bench_models import bench_model  # the children need only the checkpoint's directory
    from loadtest.fleet import rounds as fleet_rounds

    model_dir = str(bench_model(args.model, 0, 1).model_dir)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    # Every other round reversed (ABBA): neither mode always runs first.
    for mode in tqdm(fleet_rounds(list(MODES), args.rounds), desc="children", file=sys.stderr):
        runs[mode].append(run_child(mode, argv, model_dir))
    result: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "decode_seqs": args.decode_seqs}
    keys = ("prefill_ms", "prefill_faults", "prefill_faults_last", "decode_ms", "decode_faults", "maxrss_mb")
    for key in keys:
        for mode in MODES:
            result[f"{mode}_{key}"] = round(statistics.median(r[key] for r in runs[mode]), 1)
    for kind in ("prefill", "decode"):
        result[f"{kind}_speedup"] = round(result[f"default_{kind}_ms"] / result[f"kept_{kind}_ms"], 3)
    result["rounds"] = args.rounds
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
