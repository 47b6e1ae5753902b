"""Served throughput and latency against the offline engine on the same workload, in one run (issue 15).

The workload is `bench_engine`'s (`loadtest.bench_models`, `loadtest.workload`): for `tiny`, prompts of
32–512 token ids sharing system prompts, 64–256 output tokens each, 16 adapter names with Zipf popularity
and 15% base requests. It runs:
  1. offline, through an `LLMEngine` in this process: all requests added at once and stepped until done,
     as `bench_engine.run_loragate` does (the top-level `offline_tok_s`), and for each concurrency C with
     C requests in flight, the next added as one finishes (the level's `offline_tok_s`: what C clients
     can get from one engine with no fleet in between; `serve_vs_offline` divides by it, and
     `serve_vs_offline_all_at_once` by the top-level figure);
  2. for each `--concurrency` C, through a fresh `loragate up`-style stack (`loadtest.serve_stack`: an
     embedded Redis, one gateway, one worker of the same model, adapters and engine knobs), by C streaming
     clients (`loadtest.serve_clients`: the prompts' token ids, greedy, EOS ignored, so each request yields
     exactly its `max_tokens` tokens, the same work as offline). `serve_tok_s` is the output tokens streamed
     / the wall time of that level's run; TTFT, inter-token latency (ITL; how an SSE chunk of several
     tokens is counted: see `serve_clients`), errors.
Both paths first serve the same warm-up (as many 4-token requests as the most clients, the base model's and
each adapter's in turn, on prompts that leave no prefix-cache hits for the workload): model load, first
steps and adapter loads are not measured.
Each level gets a fresh stack, so that none starts with the prefix cache an earlier level left: like the
offline engine, each meets the workload once, right after the warm-up. The children run in sessions of
their own and are stopped by process group on exit, SIGTERM or Ctrl-C (and killed by the kernel if this
process is SIGKILLed).

    python -m loadtest.bench_serve --concurrency 32,64 [--model tiny|small|smollm2] [--requests 128]
        [--adapters 16] [--max-tokens N] [--max-loras 16] [--device auto|cpu|cuda[:N]]
        [--dtype auto|float32|bfloat16] [--vllm-python PATH] [--worker-flags '--threads 1 ...']

With `--vllm-python` (or `$LORAGATE_VLLM_PYTHON`: an interpreter that has vLLM, see `loadtest.bench_vllm`)
each level then runs again through vLLM's OpenAI server on the same model and adapters, after the same
warm-up, by the same clients (`loadtest.vllm_server`).

The last line printed is one JSON object: the workload, `offline_tok_s`, and per concurrency
`serve_tok_s`, `offline_tok_s`, `serve_vs_offline`, `ttft_p50_ms`, `ttft_p99_ms`, `itl_p50_ms`, `itl_p99_ms`,
`errors`, `requests` (and `tpot_p50_ms`, the median per-request mean ITL, `wall_s`, `refusals_429`,
`error_kinds`, and `cpu_s`: CPU seconds the worker, gateway, Redis and clients used during the level);
where the TTFT tail comes from: `ttft_first_wave_p50_ms` / `_max_ms` (the C requests sent at once when the
clients start) and `ttft_rest_p50_ms` / `_p99_ms` (each sent as another ended), and the same of the
offline engine at that level (`offline_ttft_p50_ms`, `offline_ttft_p99_ms`, `offline_ttft_first_wave_*`,
`offline_ttft_rest_*`: the engine's own TTFT, no fleet in between);
with vLLM also `vllm` (its `serve_tok_s`, `ttft_p50_ms`, `ttft_p99_ms`, `itl_p50_ms`, `itl_p99_ms`,
`errors`, `wall_s`), `ttft_p50_vs_vllm` and `serve_tok_s_vs_vllm`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from tqdm import tqdm

from loadtest.bench_engine import run_loragate
from loadtest.bench_models import BenchModel, bench_model, run_header
from loadtest.host import host
from loadtest.procs import BenchError, CPUMeter, ms, pct, raise_fd_limit
from loadtest.serve_clients import StreamStats, run_clients, summarize, ttft_waves
from loadtest.serve_stack import API_KEY, ServeStack
from loadtest.vllm_server import served_vllm, vllm_figures
from loadtest.workload import capped, make_workload
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.device import add_device_args, device_args
from worker.engine import LLMEngine

WARMUP_TOKENS = 4


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `with` blocks that stop the children


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_serve", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="32,64", help="comma-separated client counts (default 32,64)")
    p.add_argument("--model", default="tiny", help="tiny | small | smollm2 (loadtest.bench_models)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument(
        "--adapters", type=int, default=16, help="distinct adapter names (zoo models: their adapters reused)"
    )
    p.add_argument("--max-tokens", type=int, help="cap each request's output tokens (quick runs, tests)")
    p.add_argument("--max-loras", type=int, default=16, help="adapter slots, offline and in the worker")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("LORAGATE_VLLM_PYTHON"),
        help="also serve each level through vLLM's OpenAI server in this interpreter (loadtest.vllm_server)",
    )
    p.add_argument(
        "--worker-flags",
        default="",
        help="more `loragate worker` flags for the served worker, e.g. '--threads 1 --overlap-writes on' "
        "(the offline engine keeps this process's threads)",
    )
    add_device_args(p)
    return p


def concurrency_levels(spec: str) -> list[int]:
    levels = [int(c) for c in spec.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency: positive integers, comma-separated, not {spec!r}")
    return levels


def warmup_requests(count: int, adapters: list[str], min_token_id: int) -> list[Request]:
    """`count` requests of `WARMUP_TOKENS` tokens, the base model's and every adapter's in turn, on prompts
    that share no KV block with the workload's (a repeated token id; the workload's are random), so the
    warm-up leaves no prefix-cache hits behind."""
    names: list[str | None] = [None, *adapters]
    params = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True)
    return [
        Request(f"warmup-{i}", (min_token_id + i,) * 32, params, names[i % len(names)]) for i in range(count)
    ]


def worker_flags(config: EngineConfig, args: argparse.Namespace) -> list[str]:
    """`loragate worker` flags that build the offline engine's `config` (its adapters come by directory)."""
    return [
        *("--max-loras", str(config.max_loras), "--max-num-seqs", str(config.max_num_seqs)),
        *("--max-num-batched-tokens", str(config.max_num_batched_tokens)),
        *(("--kv-cache-mb", str(config.kv_cache_bytes // 1024**2)) if config.kv_cache_bytes else ()),
        *("--kv-prefault", "on" if config.kv_prefault else "off"),
        *("--device", args.device, "--dtype", args.dtype),
        *shlex.split(args.worker_flags),
    ]


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """The offline engine serving a level's clients: tokens per second, and each request's time from
    being added to its first token (the workload's order), the TTFT the engine gives with no fleet."""

    tok_s: float
    ttft_s: list[float]

    def figures(self, first_wave: int) -> dict[str, float]:
        return {
            "offline_ttft_p50_ms": ms(pct(self.ttft_s, 50)),
            "offline_ttft_p99_ms": ms(pct(self.ttft_s, 99)),
            **ttft_waves(self.ttft_s, first_wave, prefix="offline_ttft"),
        }


def closed_loop(engine: LLMEngine, requests: list[Request], concurrency: int, label: str) -> ClosedLoop:
    """`engine` serving `requests` with at most `concurrency` in flight, the next one added as soon as one
    finishes: what `concurrency` clients ask of a worker, minus the fleet."""
    pending = list(reversed(requests))
    total = sum(r.params.max_tokens for r in requests)
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    in_flight = 0
    start = time.perf_counter()
    with tqdm(total=total, desc=label, unit="tok", file=sys.stderr) as bar:
        while pending or engine.has_work():
            while pending and in_flight < concurrency:
                request = pending.pop()
                engine.add_request(request)
                added[request.request_id] = time.perf_counter()
                in_flight += 1
            outs = engine.step()
            now = time.perf_counter()  # when the step's tokens are out
            for out in outs:
                bar.update(len(out.new_token_ids))
                if out.new_token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = now - added[out.request_id]
                in_flight -= out.finished
    tok_s = total / (time.perf_counter() - start)
    return ClosedLoop(tok_s, [ttft[r.request_id] for r in requests])


def offline(
    bench: BenchModel, config: EngineConfig, cap: int | None, warmups: int, levels: list[int]
) -> tuple[list[Request], list[Request], float, dict[int, ClosedLoop]]:
    """The workload (output tokens capped at `cap`), the warm-up requests, the offline engine's tokens per
    second on the workload all at once, and its run with each level's number of requests in flight (each
    on a fresh engine after the warm-up, so none finds the last one's prefix cache)."""
    engine = LLMEngine(bench.model_dir, config)
    requests = make_workload(bench.workload, engine.info.vocab_size, list(bench.adapters))
    warm = warmup_requests(warmups, list(bench.adapters), bench.workload.min_token_id)
    requests = capped(requests, cap)
    engine.generate(warm)
    tok_s = run_loragate(engine, requests, "offline engine").tok_s
    per_level = {}
    for concurrency in levels:
        del engine
        gc.collect()
        engine = LLMEngine(bench.model_dir, config)
        engine.generate(warm)
        per_level[concurrency] = closed_loop(
            engine, requests, concurrency, f"offline, {concurrency} in flight"
        )
    del engine
    gc.collect()  # its KV pool and weights must not crowd the worker's
    return requests, warm, tok_s, per_level


def served(
    bench: BenchModel,
    model: str,
    flags: list[str],
    warm: list[Request],
    requests: list[Request],
    concurrency: int,
) -> tuple[list[StreamStats], float, dict[str, float]]:
    """The warm-up, then the workload, through a fresh stack by `concurrency` clients: the workload's
    per-request stats, its wall time and the CPU seconds each process used meanwhile. The warm-up also
    gives the gateway a drain rate to estimate queue waits with, as a stack that has served before has (a
    fresh gateway's, from a single short request, would refuse a burst of clients with 429:
    `gateway.overload`)."""
    with (
        tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp,
        ServeStack(Path(tmp), bench.model_dir, model, bench.adapters, flags) as stack,
    ):
        stack.wait_ready()
        warmed, _ = asyncio.run(run_clients(stack.port, API_KEY, model, warm, concurrency, "warm-up"))
        if failed := [w.error for w in warmed if w.error is not None]:
            raise BenchError(f"warm-up requests failed ({failed[:3]}):\n{stack.logs()}")
        label = f"served, {concurrency} clients"
        names = ["worker", "gateway", "redis"]
        pids = [
            stack.procs["worker"].pid,
            stack.procs["gateway"].pid,
            stack.redis.proc.pid if stack.redis.proc else 0,
        ]
        meter = CPUMeter(pids)
        results, wall = asyncio.run(run_clients(stack.port, API_KEY, model, requests, concurrency, label))
        cpu = {name: round(used, 2) for name, used in zip(names, meter.used(), strict=True)}
        cpu["clients"] = round(meter.client_used(), 2)
        if any(r.error for r in results):
            print(f"the stack's logs, last lines:\n{stack.logs()}", file=sys.stderr)
        return results, wall, cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        levels = concurrency_levels(args.concurrency)
    except ValueError as e:
        parser.error(str(e))
    device, dtype = device_args(parser, args)
    signal.signal(signal.SIGTERM, _terminate)
    raise_fd_limit()
    bench = bench_model(args.model, args.adapters, args.requests)
    config = EngineConfig(
        adapters=bench.adapters, max_loras=args.max_loras, device=device, dtype=dtype, kv_prefault=True
    )  # as its workers run
    requests, warm, offline_tok_s, closed = offline(bench, config, args.max_tokens, max(levels), levels)
    flags = worker_flags(config, args)
    per_level: dict[str, Any] = {}
    for concurrency in levels:
        results, wall, cpu = served(bench, args.model, flags, warm, requests, concurrency)
        level = {
            **summarize(results, wall, closed[concurrency].tok_s, offline_tok_s, first_wave=concurrency),
            **closed[concurrency].figures(first_wave=concurrency),
            "cpu_s": cpu,
        }
        if args.vllm_python:  # the same warm-up and clients against vLLM's server, right after
            log = Path(tempfile.gettempdir()) / f"bench-serve-vllm-{os.getpid()}-{concurrency}.log"
            dtype_spec = str(dtype).removeprefix("torch.")
            runs = served_vllm(
                args.vllm_python, bench.model_dir, args.model, bench.adapters, dtype_spec, warm, requests,
                concurrency, log,
            )  # fmt: skip
            level["vllm"] = vllm = vllm_figures(*runs)
            level["ttft_p50_vs_vllm"] = round(level["ttft_p50_ms"] / vllm["ttft_p50_ms"], 3)
            level["serve_tok_s_vs_vllm"] = round(level["serve_tok_s"] / vllm["serve_tok_s"], 3)
        per_level[str(concurrency)] = level
    result = {
        **run_header(args.model, device, dtype, requests),
        "adapters": len(bench.adapters),
        "adapter_requests": sum(r.adapter is not None for r in requests),
        "offline_tok_s": round(offline_tok_s, 1),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "concurrency": per_level,
        "host": host(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
