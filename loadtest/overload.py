"""Overload: what the gateway does with more work than the fleet can serve.

A real stack: Redis (embedded, or `$REDIS_URL`), one gateway process with `admission_wait_bound_s` set to
`--bound-s`, and workers of a known capacity: `--workers` load workers (`loadtest.load_worker`: the
worker's Redis protocol, fake tokens, no model), each running at most `--max-running` sequences of
`--tokens` tokens at one per `--interval-ms`; or, with `--real`, real `tiny` workers (`--max-num-seqs`).

1. Capacity: a closed loop of 2 × (workers × max running) users, each sending its next streaming request
   as soon as the last ends, for `--capacity-s`; capacity = complete requests per second over the second
   half (the first fills the pipeline).
2. For each of `--multiples` (default 4 and 10): Poisson arrivals at that multiple of the capacity for
   `--phase-s`, one new connection per request, every request followed to its end; meanwhile a separate
   process probes `/health` every 50 ms on a new connection (`loadtest.health_probe`).

Per phase: admitted requests' TTFT (send → first token), 429s (with their codes, how fast they came, and
`Retry-After`), other errors (any other status, connect failures, incomplete streams, timeouts), complete
requests per second, and `/health` latency. The last line printed is one JSON object: per-phase figures
under `runs`, and at top level `queue_wait_bound_s`, `capacity_rps` and the worst over the phases of
`offered_x_capacity` (the highest), `admitted_ttft_p99_s`, `health_p99_ms` (the highest), `rejected_429`
and `errors_other` (summed).

    python -m loadtest.overload [--bound-s 2] [--workers 2] [--max-running 4] [--tokens 20]
                                [--interval-ms 50] [--multiples 4 10] [--phase-s 20] [--real]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from loadtest.health_probe import HealthProbe
from loadtest.overload_client import Result, Target, closed_loop, completion_request, open_loop
from loadtest.procs import CPUMeter, Processes, free_port, pct, raise_fd_limit, wait_healthy
from loragate.embedded_redis import redis_url
from worker.modelzoo.make import ensure_zoo


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `with` blocks that stop the children


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.overload", description=__doc__.split("\n")[0])
    p.add_argument("--bound-s", type=float, default=2.0, help="admission_wait_bound_s (0: off, as before)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-running", type=int, default=4, help="sequences per worker at once")
    p.add_argument("--tokens", type=int, default=20, help="max_tokens of every request")
    p.add_argument("--interval-ms", type=float, default=50.0, help="load workers: between two tokens")
    p.add_argument("--multiples", type=float, nargs="+", default=[4.0, 10.0], help="offered × capacity")
    p.add_argument("--capacity-s", type=float, default=10.0)
    p.add_argument("--phase-s", type=float, default=20.0, help="arrivals last this long per multiple")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real", action="store_true", help="real tiny workers instead of load workers")
    return p


def start_stack(args: argparse.Namespace, procs: Processes, work: Path, key: str) -> tuple[str, str, int]:
    """Workers and a gateway; returns (gateway URL, model name, gateway pid)."""
    model_dir = ensure_zoo().base("tiny")
    model = "tiny" if args.real else "tiny-load"
    for i in range(args.workers):
        if args.real:
            flags = ["--model", str(model_dir), "--model-name", model, "--worker-id", f"tiny-{i}"]
            flags += ["--max-num-seqs", str(args.max_running)]
            procs.spawn(f"worker-{i}", ["-m", "loragate.cli", "worker", *flags], {"OMP_NUM_THREADS": "1"})
        else:
            flags = ["--worker-id", f"load-{i}", "--model-name", model, "--model-dir", str(model_dir)]
            flags += ["--interval-ms", str(args.interval_ms), "--max-running", str(args.max_running)]
            procs.spawn(f"worker-{i}", ["-m", "loadtest.load_worker", *flags])
    config = work / "gateway.json"
    config.write_text(json.dumps({"api_keys": {key: "bench"}, "admission_wait_bound_s": args.bound_s}))
    port = free_port()
    flags = ["--host", "127.0.0.1", "--port", str(port), "--config", str(config)]
    pid = procs.spawn("gateway", ["-m", "loragate.cli", "gateway", *flags])
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, model, procs)
    return base, model, pid


def capacity_rps(results: list[Result], started: float, duration_s: float) -> float:
    half = started + duration_s / 2
    done = [r for r in results if r.ok and r.ended_at >= half]
    return len(done) / max(1e-9, max((r.ended_at for r in done), default=half) - half)


def summarise(multiple: float, rate: float, results: list[Result], duration_s: float) -> dict[str, Any]:
    admitted = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    other = [r for r in results if not r.ok and r.status != 429]
    ttft = [r.ttft_s for r in admitted if r.ttft_s is not None]
    end = min((r.sent_at for r in results), default=0.0) + duration_s  # complete within the phase
    kinds = Counter(r.error or f"http {r.status}" for r in other)
    return {
        "offered_x_capacity": multiple,
        "offered_rps": round(rate, 2),
        "sent": len(results),
        "admitted": len(admitted),
        "completed_ok": sum(r.ok for r in results),
        "goodput_rps": round(sum(r.ok and r.ended_at <= end for r in results) / duration_s, 2),
        "admitted_ttft_p50_s": round(pct(ttft, 50), 3),
        "admitted_ttft_p99_s": round(pct(ttft, 99), 3),
        "admitted_ttft_max_s": round(max(ttft, default=float("nan")), 3),
        "rejected_429": len(refused),
        "rejected_codes": dict(Counter(r.code or "none" for r in refused)),
        "refusal_p99_ms": round(pct([r.head_s for r in refused], 99) * 1000, 1),
        "retry_after_p50_s": pct([r.retry_after_s for r in refused if r.retry_after_s is not None], 50),
        "errors_other": len(other),
        "error_kinds": dict(kinds),
    }


def health(result: dict[str, Any], probe: HealthProbe) -> dict[str, Any]:
    latencies = probe.result.latencies_ms
    return result | {
        "health_probes": len(latencies) + probe.result.failures,
        "health_failures": probe.result.failures,
        "health_p50_ms": round(pct(latencies, 50), 2),
        "health_p99_ms": round(pct(latencies, 99), 2),
        "health_max_ms": round(max(latencies, default=float("nan")), 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    key = f"sk-bench-{secrets.token_hex(8)}"
    out: dict[str, Any] = {"queue_wait_bound_s": args.bound_s, "workers": args.workers, "real": args.real}
    out |= {"max_running": args.max_running, "tokens": args.tokens, "cpus": os.cpu_count()}
    if not args.real:
        out["interval_ms"] = args.interval_ms
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        work = Path(tmp)
        with redis_url(work / "redis") as url:
            env = {**os.environ, "REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
            with Processes(work, env) as procs:
                base, model, pid = start_stack(args, procs, work, key)
                port = int(base.rsplit(":", 1)[1])
                target = Target(port, completion_request(port, key, model, args.tokens), args.tokens)
                with HealthProbe(base) as idle:
                    time.sleep(2.0)
                out["health_idle_p99_ms"] = health({}, idle)["health_p99_ms"]
                users = 2 * args.workers * args.max_running
                started = time.monotonic()
                results = asyncio.run(
                    closed_loop(target, users, args.capacity_s, f"capacity ({users} users)")
                )
                capacity = capacity_rps(results, started, args.capacity_s)
                out["capacity_rps"] = round(capacity, 2)
                out["capacity_phase"] = summarise(0, 0, results, args.capacity_s)
                print(f"capacity: {capacity:.2f} requests/s", file=sys.stderr)
                runs = []
                for i, multiple in enumerate(args.multiples):
                    rate = multiple * capacity
                    cpu = CPUMeter([pid])
                    with HealthProbe(base) as probe:
                        coro = open_loop(target, rate, args.phase_s, args.seed + i, f"{multiple:g}x capacity")
                        results = asyncio.run(coro)
                    procs.check()
                    row = health(summarise(multiple, rate, results, args.phase_s), probe)
                    row["gateway_cpu_s"] = round(cpu.used()[0], 2)
                    print(json.dumps(row), file=sys.stderr)
                    runs.append(row)
    return out | {
        "offered_x_capacity": max(r["offered_x_capacity"] for r in runs),
        "admitted_ttft_p99_s": max(r["admitted_ttft_p99_s"] for r in runs),
        "rejected_429": sum(r["rejected_429"] for r in runs),
        "errors_other": sum(r["errors_other"] for r in runs),
        "health_p99_ms": max(r["health_p99_ms"] for r in runs),
        "runs": runs,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    raise_fd_limit()
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
