"""The CPU runtime a worker runs under, compared side by side: allocators and OpenMP libraries preloaded.

vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (`libiomp5`, which also answers for GNU's libgomp
that torch is built against). Whether they pay off for loragate is a few per cent, smaller than this
machine's drift between two whole runs, so the variants are interleaved finely instead:
  - each variant is a child process of its own (`--child`, started with the variant's environment, e.g.
    `LD_PRELOAD`), holding an engine built as `loragate worker` builds it (base model, KV pool committed at
    start), warmed up off the clock;
  - the workload (`loadtest.bench_models`: base requests, or with `--lora` the mixed adapter requests of
    `bench_vllm`'s LoRA job, every adapter loaded) is cut in slices of `--slice` requests; a round
    lets every child run the same slice in turn, one at a time (the others wait on a pipe, idle), every
    other round in reverse order;
  - a variant's figure is the median over rounds of its throughput divided by the first variant's in the
    same round.

    python -m loadtest.bench_cpu_runtime [--model smollm2] [--rounds 8] [--max-tokens N] \\
        --variant plain= --variant tcmalloc=LD_PRELOAD=/path/libtcmalloc_minimal.so.4 \\
        --variant iomp5+tcmalloc=LD_PRELOAD=/path/libiomp5.so:/path/libtcmalloc_minimal.so.4

`--lora` runs the mixed adapter workload (old and new kernels side by side: `NAME=PYTHONPATH=/checkout`).
`--max-tokens N` caps each request's output tokens (quick runs, tests: the same prompts). A variant is
`NAME=` (this process's environment) or `NAME=VAR=VALUE[,VAR=VALUE...]`. The last line printed is one JSON
object: `model`, `dtype`, `lora`, `rounds`, `slice_requests`, `baseline` (the first variant) and per
variant its environment, the torch threads its engine ran (`threads`), `tok_s` (its median slice
throughput), `ratio` (its median ratio to the baseline) and `ratios` (each round's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any

from tqdm import tqdm

from loragate.proc import exit_on_stop_signal, spawn


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME=` or `NAME=VAR=VALUE[,VAR=VALUE...]` as the name and its environment."""
    name, sep, rest = spec.partition("=")
    if not name or not sep:
        raise ValueError(f"a variant is NAME= or NAME=VAR=VALUE[,VAR=VALUE...], got {spec!r}")
    env: dict[str, str] = {}
    for pair in filter(None, rest.split(",")):
        var, eq, value = pair.partition("=")
        if not var or not eq:
            raise ValueError(f"variant {name}: {pair!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_cpu_runtime", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="smollm2", help="bench model (loadtest.bench_models)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=128, help="the workload's requests")
    p.add_argument("--slice", type=int, default=32, help="requests each child runs per turn")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-tokens", type=int, help="cap each request's output tokens (quick runs, tests)")
    p.add_argument("--lora", action="store_true", help="the mixed adapter workload, not the base one")
    p.add_argument("--max-num-seqs", type=int, default=128, help="each engine's running-batch cap")
    p.add_argument("--kv-cache-mb", type=int, default=2048, help="each engine's KV pool (committed at start)")
    p.add_argument("--variant", action="append", default=[], help="NAME= or NAME=VAR=VALUE[,VAR=VALUE...]")
    p.add_argument("--child", nargs=1, metavar="JOB", help=argparse.SUPPRESS)
    return p


def child(job: dict[str, Any], stdin: IO[str], stdout: IO[str]) -> None:
    """Build and warm the engine, say READY, then run the slice named on each line of `stdin`."""
    from pathlib import Path

    import torch

    from loragate.types import Request, SamplingParams
    from worker.config import EngineConfig
    from worker.device import DTYPES
    from worker.engine import LLMEngine

    config = EngineConfig(
        device="cpu",
        dtype=DTYPES[job["dtype"]],
        max_num_seqs=job["max_num_seqs"],
        kv_cache_bytes=job["kv_cache_mb"] * 2**20,
        kv_prefault=True,
        adapters={name: Path(path) for name, path in job["adapters"].items()},
        max_loras=max(len(job["adapters"]), 1),
    )
    engine = LLMEngine(job["model_dir"], config)
    turns = 0

    def requests(rs: list[dict[str, Any]]) -> list[Request]:
        return [
            Request(
                f"t{turns}-{i}",
                tuple(r["prompt"]),
                SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                r["adapter"],
            )
            for i, r in enumerate(rs)
        ]

    engine.generate(requests(job["warmup"]))
    print("READY", torch.get_num_threads(), file=stdout, flush=True)
    for line in stdin:
        piece = job["slices"][int(line) % len(job["slices"])]
        turns += 1
        start = time.perf_counter()
        outputs = engine.generate(requests(piece))
        elapsed = time.perf_counter() - start
        print("DONE", sum(len(o.token_ids) for o in outputs) / elapsed, file=stdout, flush=True)


def make_job(args: argparse.Namespace) -> dict[str, Any]:
    from loadtest import bench_vllm

    adapters = bench_vllm.build_parser().get_default("adapters")  # bench_vllm's requests (and adapters)
    base = bench_vllm.make_jobs(args.model, args.dtype, adapters, args.requests)[
        "lora" if args.lora else "base"
    ]
    cap = args.max_tokens
    rs = [{**r, "max_tokens": min(cap, r["max_tokens"])} if cap else r for r in base["requests"]]
    return {
        "model_dir": base["model_dir"],
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_mb": args.kv_cache_mb,
        "adapters": base["adapters"] if args.lora else {},
        "warmup": base["warmup"],
        "slices": [rs[i : i + args.slice] for i in range(0, len(rs), args.slice)],
    }


def _reply(proc: subprocess.Popen[str], name: str, word: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(word):
            return line[len(word) :].strip()
    raise SystemExit(f"variant {name}: its child exited ({proc.wait()})")


def summary(
    names: list[str], envs: dict[str, dict[str, str]], rates: dict[str, list[float]], threads: dict[str, int]
) -> dict[str, Any]:
    """Each variant's median throughput and its median per-round ratio to the first variant's."""
    base = rates[names[0]]
    out: dict[str, Any] = {}
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], base, strict=True)]
        out[name] = {
            "env": envs[name],
            "threads": threads[name],
            "tok_s": round(statistics.median(rates[name]), 1),
            "ratio": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios],
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_stop_signal()  # unwinds through the clean-up below, which kills the children
    if args.child:
        with open(args.child[0]) as f:
            child(json.load(f), sys.stdin, sys.stdout)
        return 0
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as e:
        parser.error(str(e))
    if len(variants) < 2 or args.rounds < 1 or args.slice < 1:
        parser.error("name at least two --variant, and --rounds and --slice of at least 1")
    names = list(variants)
    job_file = os.path.join(tempfile.gettempdir(), f"bench-cpu-runtime-{os.getpid()}.json")
    with open(job_file, "w") as f:
        json.dump(make_job(args), f)
    procs: dict[str, subprocess.Popen[str]] = {}
    rates: dict[str, list[float]] = {n: [] for n in names}
    threads: dict[str, int] = {}
    try:
        for name in tqdm(names, desc="engines", file=sys.stderr):
            procs[name] = spawn(  # type: ignore[assignment]
                [sys.executable, "-m", "loadtest.bench_cpu_runtime", "--child", job_file],
                env={**os.environ, **variants[name]},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            # one at a time: a loading child would slow the others
            threads[name] = int(_reply(procs[name], name, "READY"))
        for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
            for name in names if r % 2 == 0 else names[::-1]:
                stdin = procs[name].stdin
                assert stdin is not None
                stdin.write(f"{r}\n")
                stdin.flush()
                rates[name].append(float(_reply(procs[name], name, "DONE")))
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):  # a pipe to a killed child: nothing to flush
                        pipe.close()
        os.unlink(job_file)
    result = {"model": args.model, "dtype": args.dtype, "lora": args.lora, "rounds": args.rounds}
    result["slice_requests"] = args.slice
    print(json.dumps({**result, "baseline": names[0], "variants": summary(names, variants, rates, threads)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
