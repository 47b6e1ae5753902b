"""What the gateway costs: TTFT added over the in-process engine, and concurrent streams per gateway process.

1. Added TTFT. A real Redis (embedded), one real worker process and one gateway process (uvicorn, over
   loopback). `--requests` short completions (temperature 0, `--ttft-tokens` tokens each) go one at a
   time through an `LLMEngine` in this process (same model, config, prompts, thread count; `add_request`
   → the first `step()` output the gateway would relay as content) and through the gateway (streaming:
   send → first SSE content chunk), from a minimal raw-socket HTTP/1.1 client (`loadtest.sse_client`, so
   the figure is the gateway's, not an HTTP library's) and from httpx (what a typical Python client
   sees), the order rotating so that machine noise hits every path alike (`loadtest.gateway_ttft`).
   Reported: p50/p99 of each, the differences (`added_ttft_*`: raw client; `added_ttft_httpx_*`), and the
   median of per-request differences; then the same with warm paths (`*_warm_*`: each path serves
   another prompt right before the measured one; a second view, see `measure_ttft`). A last, shorter
   pass runs with Redis `MONITOR` on and splits each gateway request into stages by the commands' server
   timestamps.
2. Concurrent streams. The real worker and that gateway stop; token-emitting *load workers*
   (`loadtest.load_worker.LoadWorker`: the worker's Redis protocol, fake tokens, no model; serving the
   base name `tiny-load`) and a fresh gateway start. First `--floor-requests` sequential one-token requests
   measure the path's own TTFT (gateway + Redis + a worker loop that computes nothing). Then `--streams`
   streaming requests are opened evenly over `--ramp-s` (each lasts longer, so all are open at once) from a
   raw-asyncio HTTP/1.1 client (light, to leave the CPU to the gateway; `loadtest.gateway_streams`), each
   streaming `--tokens` tokens one per `--interval-ms`. A stream is ok when it got every token, the usage
   chunk and `[DONE]`, and no error. Reported: ok count, errors by kind, peak open streams, gateway RSS
   and CPU.

The last line printed is one JSON object.

    python -m loadtest.bench_gateway [--requests 100] [--streams 1000] [--tokens 50] [--interval-ms 200]
                                     [--ramp-s 1] [--ttft-tokens 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import torch

from loadtest.gateway_streams import open_streams, port_of
from loadtest.gateway_ttft import STAGES, TTFTRun, measure_floor, measure_stages, measure_ttft, prompts
from loadtest.procs import (
    CPUMeter,
    Processes,
    Sampler,
    free_port,
    ms,
    pct,
    raise_fd_limit,
    rss_mb,
    wait_healthy,
)
from loragate.embedded_redis import redis_url
from policies.default_policy import DEFAULT_POLICY
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ensure_zoo

MODEL = "tiny"
LOAD_MODEL = "tiny-load"  # what the load workers serve, so no request reaches them by mistake

Rows = list[tuple[str, str]]


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `with` blocks that stop the children


def table(rows: Rows) -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_gateway", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="sequential requests of each TTFT pass")
    p.add_argument("--ttft-tokens", type=int, default=8, help="max_tokens of a TTFT request")
    p.add_argument("--stage-requests", type=int, default=30, help="requests of the MONITOR pass (0: none)")
    p.add_argument("--floor-requests", type=int, default=100, help="TTFT requests to a load worker (0: none)")
    p.add_argument("--streams", type=int, default=1000, help="concurrent streams")
    p.add_argument("--tokens", type=int, default=50, help="tokens per concurrent stream")
    p.add_argument(
        "--interval-ms",
        type=float,
        default=200.0,
        help="load workers' inter-token interval (200 ms × 50 tokens keeps 1,000 streams open at once)",
    )
    p.add_argument(
        "--ramp-s", type=float, default=1.0, help="open the streams evenly over this time (0: at once)"
    )
    p.add_argument("--load-workers", type=int, default=1)
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="queue bound (the policy's queue-bound max_outstanding) of the streams gateway (default "
        "max(1024, 2 × streams): a worker's queue length counts its running requests too, and a load "
        "worker runs them all)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads, in this process and in the worker")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--skip-streams", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    fd_limit = raise_fd_limit()
    torch.set_num_threads(args.threads)
    model_dir = ensure_zoo().base(MODEL)
    key = f"sk-bench-{secrets.token_hex(8)}"
    result: dict[str, Any] = {
        "model": MODEL,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "fd_limit": fd_limit,
    }
    rows: Rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        work = Path(tmp)
        with redis_url(work / "redis") as url:
            env = {**os.environ, "REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
            with Processes(work, env) as procs:
                if not args.skip_ttft:
                    result |= ttft_phase(args, procs, work, url, key, model_dir, rows)
                if not args.skip_streams:
                    result |= streams_phase(args, procs, work, key, model_dir, rows)
    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print("\ngateway benchmark\n" + table(rows))
    print(json.dumps(result))
    return 0


def start_gateway(
    procs: Processes, work: Path, name: str, key: str, extra: dict[str, Any]
) -> tuple[str, int]:
    config = work / f"{name}.json"
    config.write_text(json.dumps({"api_keys": {key: "bench"}, **extra}))
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--config", str(config)]
    pid = procs.spawn(name, ["-m", "loragate.cli", "gateway", *args])
    return f"http://127.0.0.1:{port}", pid


def set_queue_bound(base: str, admin: str, max_outstanding: int) -> None:
    """The queue bound lives in the routing policy: store a copy of the default with a larger bound."""
    doc = json.loads(json.dumps(DEFAULT_POLICY))
    for plugin in doc["plugins"]:
        if plugin["type"] == "queue-bound":
            plugin["parameters"] = {**plugin.get("parameters", {}), "max_outstanding": max_outstanding}
    resp = httpx.put(
        f"{base}/admin/policy", json=doc, headers={"Authorization": f"Bearer {admin}"}, timeout=10
    )
    resp.raise_for_status()


def ttft_phase(
    args: argparse.Namespace, procs: Processes, work: Path, url: str, key: str, model_dir: Path, rows: Rows
) -> dict[str, Any]:
    worker = ["--model", str(model_dir), "--model-name", MODEL, "--worker-id", "bench-w0"]
    procs.spawn("worker", ["-m", "loragate.cli", "worker", *worker], {"OMP_NUM_THREADS": str(args.threads)})
    base, _ = start_gateway(procs, work, "gateway-ttft", key, {})
    engine = LLMEngine(model_dir, EngineConfig())  # what `loragate worker` builds with its default flags
    gc.collect()
    gc.freeze()  # as `loragate worker` does once its engine is built: no full GC pauses on either path
    wait_healthy(base, MODEL, procs)
    texts = prompts(args.requests + 10)
    measure_ttft(base, key, MODEL, engine, texts[:10], args.ttft_tokens, "warm-up")
    run = measure_ttft(base, key, MODEL, engine, texts[10:], args.ttft_tokens, "TTFT: gateway vs engine")
    warm = measure_ttft(base, key, MODEL, engine, texts[10:], args.ttft_tokens, "TTFT, warm paths", warm=True)
    out: dict[str, Any] = {
        "ttft_requests": len(run.gateway_s),
        "ttft_max_tokens": args.ttft_tokens,
        "ttft_client": "raw-socket HTTP/1.1, keep-alive (loadtest.sse_client)",
        **ttft_figures(run, ""),
        **ttft_figures(warm, "_warm"),
        "ttft_outputs_match": run.mismatches == 0 and warm.mismatches == 0,
    }
    rows += [
        *ttft_rows(out, "", "TTFT p50 / p99"),
        *ttft_rows(out, "_warm", "TTFT p50 / p99, warm paths"),
        ("same text every way", str(out["ttft_outputs_match"])),
    ]
    if args.stage_requests > 0:
        stages = measure_stages(base, key, url, MODEL, texts[10 : 10 + args.stage_requests], args.ttft_tokens)
        split = {k: ms(pct([s[i] for s in stages.samples], 50)) for i, (k, _) in enumerate(STAGES)}
        out |= {"stages_p50_ms": split, "stages_requests": len(stages.samples)}
        out["stages_client_unblocks"] = stages.unblocks
        rows += [(f"p50 {text}", f"{split[k]:.3f} ms") for k, text in STAGES]
    procs.stop("gateway-ttft", "worker")
    return out


def ttft_figures(run: TTFTRun, suffix: str) -> dict[str, Any]:
    """`{path}{suffix}_p50_ms` and `_p99_ms` for each path and difference (raw client unless `httpx`)."""
    paired = [g - e for g, e in zip(run.gateway_s, run.engine_s, strict=True)]
    out: dict[str, Any] = {}
    for q in (50, 99):
        gateway, engine, via_httpx = pct(run.gateway_s, q), pct(run.engine_s, q), pct(run.httpx_s, q)
        out |= {
            f"gateway_ttft{suffix}_p{q}_ms": ms(gateway),
            f"engine_ttft{suffix}_p{q}_ms": ms(engine),
            f"added_ttft{suffix}_p{q}_ms": ms(gateway - engine),
            f"gateway_ttft_httpx{suffix}_p{q}_ms": ms(via_httpx),
            f"added_ttft_httpx{suffix}_p{q}_ms": ms(via_httpx - engine),
        }
    out[f"added_ttft_paired{suffix}_p50_ms"] = ms(pct(paired, 50))
    return out


def ttft_rows(out: dict[str, Any], suffix: str, title: str) -> Rows:
    def pair(name: str) -> str:
        return f"{out[f'{name}{suffix}_p50_ms']:.2f} / {out[f'{name}{suffix}_p99_ms']:.2f} ms"

    paired = out[f"added_ttft_paired{suffix}_p50_ms"]
    return [
        (f"{title}: gateway", pair("gateway_ttft")),
        (f"{title}: in-process engine", pair("engine_ttft")),
        (f"{title}: added", pair("added_ttft") + f" (median of pairs {paired:.2f})"),
        (f"{title}: gateway via httpx", pair("gateway_ttft_httpx")),
        (f"{title}: added via httpx", pair("added_ttft_httpx")),
    ]


def streams_phase(
    args: argparse.Namespace, procs: Processes, work: Path, key: str, model_dir: Path, rows: Rows
) -> dict[str, Any]:
    load_pids = []
    for i in range(args.load_workers):
        flags = ["--worker-id", f"load-{i}", "--model-name", LOAD_MODEL, "--model-dir", str(model_dir)]
        flags += ["--interval-ms", str(args.interval_ms)]
        load_pids.append(procs.spawn(f"load-worker-{i}", ["-m", "loadtest.load_worker", *flags]))
    max_queue = args.max_queue or max(1024, 2 * args.streams)
    admin = "bench-admin"
    extra = {"admin_token": admin, "fair_admission_per_worker": max_queue}
    base, pid = start_gateway(procs, work, "gateway-streams", key, extra)
    wait_healthy(base, LOAD_MODEL, procs)
    set_queue_bound(base, admin, max_queue)
    out: dict[str, Any] = {}
    if args.floor_requests > 0:
        floor = measure_floor(base, key, LOAD_MODEL, args.floor_requests)
        out |= {"path_floor_ttft_p50_ms": ms(pct(floor, 50)), "path_floor_ttft_p99_ms": ms(pct(floor, 99))}
        rows.append(
            (
                "TTFT p50 / p99, gateway + zero-compute load worker",
                f"{out['path_floor_ttft_p50_ms']:.2f} / {out['path_floor_ttft_p99_ms']:.2f} ms",
            )
        )
    idle_rss = rss_mb(pid)
    cpu = CPUMeter([pid, *load_pids])
    timeout_s = args.ramp_s + max(120.0, args.tokens * args.interval_ms / 1000 * 30)
    start = time.perf_counter()
    with Sampler(pid).sampling() as sampler:
        tally = asyncio.run(
            open_streams(port_of(base), key, LOAD_MODEL, args.streams, args.tokens, args.ramp_s, timeout_s)
        )
    elapsed = time.perf_counter() - start
    gateway_cpu, *load_cpu = cpu.used()
    client_cpu = cpu.client_used()
    procs.check()
    out |= {
        "concurrent_streams_ok": tally.ok,
        "concurrent_streams_requested": args.streams,
        "concurrent_streams_peak_open": tally.peak_open,
        "concurrent_stream_errors": sum(tally.errors.values()),
        "concurrent_stream_error_kinds": dict(tally.errors),
        "stream_tokens": args.tokens,
        "stream_interval_ms": args.interval_ms,
        "streams_ramp_s": args.ramp_s,
        "streams_wall_s": round(elapsed, 2),
        "streams_tokens_relayed": tally.tokens,
        "streams_tokens_per_s": round(tally.tokens / elapsed, 1),
        "streams_ttft_p50_ms": ms(pct(tally.ttft_s, 50)),
        "streams_ttft_p99_ms": ms(pct(tally.ttft_s, 99)),
        "gateway_rss_idle_mb": round(idle_rss, 1) if idle_rss else None,
        "gateway_rss_peak_mb": round(sampler.peak_mb, 1),
        "gateway_cpu_s": round(gateway_cpu, 2),
        "gateway_cpu_us_per_token": round(gateway_cpu / tally.tokens * 1e6, 1) if tally.tokens else None,
        "load_workers_cpu_s": round(sum(load_cpu), 2),
        "client_cpu_s": round(client_cpu, 2),
        "gateway_max_outstanding_per_worker": max_queue,
        "load_workers": args.load_workers,
    }
    errors = json.dumps(dict(tally.errors)) if tally.errors else "none"
    rows += [
        ("concurrent streams ok / requested", f"{tally.ok} / {args.streams}"),
        ("peak open streams", str(tally.peak_open)),
        ("stream errors", errors),
        ("streams: wall, tokens/s", f"{elapsed:.1f} s, {out['streams_tokens_per_s']:.0f} tok/s"),
        (
            "streams: TTFT p50 / p99",
            f"{out['streams_ttft_p50_ms']:.1f} / {out['streams_ttft_p99_ms']:.1f} ms",
        ),
        ("gateway RSS idle → peak", f"{out['gateway_rss_idle_mb']} → {out['gateway_rss_peak_mb']} MB"),
        ("gateway CPU, per relayed token", f"{gateway_cpu:.1f} s, {out['gateway_cpu_us_per_token']} µs"),
        ("CPU of load workers / client", f"{sum(load_cpu):.1f} s / {client_cpu:.1f} s"),
    ]
    if tally.errors:
        print(f"gateway log, last lines:\n{procs.tail('gateway-streams', 30)}", file=sys.stderr)
    procs.stop("gateway-streams", *(f"load-worker-{i}" for i in range(args.load_workers)))
    return out


if __name__ == "__main__":
    sys.exit(main())
