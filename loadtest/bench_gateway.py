"""What the gateway costs: TTFT added over the in-process engine, and concurrent streams per gateway process.

1. Added TTFT. A real Redis (embedded), one real worker process and one gateway process (uvicorn, over
   loopback). `--requests` short completions (temperature 0, `--ttft-tokens` tokens each) go one at a
   time through the gateway (httpx, streaming: send → first SSE content chunk) and, alternately, through
   an `LLMEngine` in this process (same model, config, prompts, thread count; `add_request` → the first
   `step()` output the gateway would relay as content), so machine noise hits both alike. Reported: p50/p99
   of each, their differences, and the median of per-request differences. A second, shorter pass runs with
   Redis `MONITOR` on and splits each gateway request into stages by the commands' server timestamps.
2. Concurrent streams. The real worker and that gateway stop; token-emitting *load workers*
   (`loadtest.load_worker.LoadWorker`: the worker's Redis protocol, fake tokens, no model; serving the
   base name `tiny-load`) and a fresh gateway start. First `--floor-requests` sequential one-token requests
   measure the path's own TTFT (gateway + Redis + a worker loop that computes nothing). Then `--streams`
   streaming requests are opened evenly over `--ramp-s` (each lasts longer, so all are open at once) from a
   raw-asyncio HTTP/1.1 client (light, to leave the CPU to the gateway), each streaming `--tokens` tokens
   one per `--interval-ms`. A stream is ok when it got every token, the usage chunk and `[DONE]`, and no
   error. Reported: ok count, errors by kind, peak open streams, gateway RSS and CPU.

The last line printed is one JSON object.

    python -m loadtest.bench_gateway [--requests 100] [--streams 1000] [--tokens 50] [--interval-ms 200]
                                     [--ramp-s 1] [--ttft-tokens 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import numpy as np
import redis
import torch
from tqdm import tqdm

from gateway.tokenize import load_tokenizer
from loragate import keys
from loragate.embedded_redis import redis_url
from loragate.types import Request, SamplingParams
from policies.default_policy import DEFAULT_POLICY
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ensure_zoo

MODEL = "tiny"
LOAD_MODEL = "tiny-load"  # what the load workers serve, so no request reaches them by mistake
TOPICS = ("cats", "rivers", "compilers", "tea", "glaciers", "chess", "bread", "comets", "jazz", "moss")


class BenchError(RuntimeError):
    pass


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# -- processes ------------------------------------------------------------------------------------------
class Processes:
    """Child processes, logged to files, all stopped on exit (SIGTERM, then SIGKILL after a grace)."""

    def __init__(self, logs: Path, env: dict[str, str]):
        self.logs, self.env = logs, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> int:
        log = (self.logs / f"{name}.log").open("wb")
        env = {**self.env, **(extra_env or {})}
        self.procs[name] = subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=log)
        log.close()
        return self.procs[name].pid

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise BenchError(f"{name} exited ({proc.returncode}):\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, *names: str, grace_s: float = 15.0) -> None:
        chosen = [n for n in (names or tuple(self.procs)) if n in self.procs]
        for name in chosen:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in chosen:
            proc = self.procs.pop(name)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(base: str, model: str, procs: Processes, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        with contextlib.suppress(httpx.HTTPError):
            if model in httpx.get(f"{base}/health", timeout=2).json().get("models", []):
                return
        time.sleep(0.2)
    raise BenchError(f"the gateway at {base} did not report a worker for {model!r} in {timeout_s} s")


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def cpu_s(pid: int) -> float | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


# -- 1. added TTFT ------------------------------------------------------------------------------------
@dataclass
class TTFTRun:
    gateway_s: list[float] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    engine_first_token_s: list[float] = field(default_factory=list)
    mismatches: int = 0


def prompts(n: int) -> list[str]:
    return [f"Note {i} on {TOPICS[i % len(TOPICS)]}: write two short lines about it." for i in range(n)]


def gateway_request(
    client: httpx.Client, base: str, prompt: str, max_tokens: int, model: str = MODEL
) -> tuple[float, str]:
    """Seconds from sending to the first SSE content chunk, and the whole text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    first: float | None = None
    pieces: list[str] = []
    done = False
    start = time.perf_counter()
    with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise BenchError(f"gateway answered {resp.status_code}: {resp.read().decode(errors='replace')}")
        for line in resp.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise BenchError(f"stream error: {chunk['error']}")
            choice = chunk["choices"][0]
            if first is None and (choice["text"] or choice["finish_reason"]):
                first = now - start
            pieces.append(choice["text"])
    if first is None or not done:
        raise BenchError("the stream ended without content or [DONE]")
    return first, "".join(pieces)


def engine_request(engine: LLMEngine, rid: str, ids: list[int], max_tokens: int) -> tuple[float, float, str]:
    """Seconds from `add_request` to the first output the gateway would relay as content (and to the
    first token), and the whole text."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first: float | None = None
    first_token: float | None = None
    pieces: list[str] = []
    start = time.perf_counter()
    engine.add_request(Request(rid, tuple(ids), params))
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if first_token is None and out.new_token_ids:
                first_token = now - start
            if first is None and (out.text_delta or out.finished):
                first = now - start
            pieces.append(out.text_delta)
    assert first is not None and first_token is not None
    return first, first_token, "".join(pieces)


def measure_ttft(
    base: str, key: str, engine: LLMEngine, texts: list[str], max_tokens: int, label: str
) -> TTFTRun:
    tok = load_tokenizer(engine.model_dir)
    run = TTFTRun()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(headers=headers, timeout=60) as client:
        for i, text in enumerate(tqdm(texts, desc=label, unit="req", file=sys.stderr)):
            ids = tok.encode(text)

            def via_engine(i: int = i, ids: list[int] = ids) -> tuple[float, float, str]:
                return engine_request(engine, f"{label}-{i}", ids, max_tokens)

            # Alternate which path goes first, so drifts in machine load hit both alike.
            if i % 2 == 0:
                g, g_text = gateway_request(client, base, text, max_tokens)
                e, e_tok, e_text = via_engine()
            else:
                e, e_tok, e_text = via_engine()
                g, g_text = gateway_request(client, base, text, max_tokens)
            run.gateway_s.append(g)
            run.engine_s.append(e)
            run.engine_first_token_s.append(e_tok)
            run.mismatches += g_text != e_text
    return run


# Stages of one gateway request, between Redis MONITOR timestamps of its commands and the client's clock.
STAGES = (
    ("http_in_and_handler", "client send → gateway's EXISTS (HTTP in, auth, parse, tokenize, route)"),
    ("gateway_enqueue", "EXISTS → XADD lg:q (admission, routing, decision record, subscribe)"),
    ("worker", "XADD lg:q → XADD lg:out (XREADGROUP wakes, add_request, engine step(s), publish)"),
    ("relay_out", "XADD lg:out → first SSE chunk at the client (mux, handler, HTTP out)"),
)


@dataclass
class Stages:
    samples: list[list[float]] = field(default_factory=list)  # per request: seconds per stage
    unblocks: int = 0  # CLIENT UNBLOCKs the gateway's output relay needed


def measure_stages(base: str, key: str, url: str, texts: list[str], max_tokens: int) -> Stages:
    """Gateway requests with Redis MONITOR on: where the time between send and first chunk goes."""
    monitor_client = redis.Redis.from_url(url)
    marker = f"bench-monitor-stop-{secrets.token_hex(4)}"
    seen: list[tuple[float, str]] = []
    ready = threading.Event()

    def listen() -> None:
        with monitor_client.monitor() as m:
            ready.set()
            for cmd in m.listen():
                seen.append((float(cmd["time"]), str(cmd["command"])))
                if marker in cmd["command"]:
                    return

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    ready.wait(10)
    time.sleep(0.2)
    client_times: list[tuple[str, float, float]] = []
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(headers=headers, timeout=60) as client:
        for i, text in enumerate(tqdm(texts, desc="stage split (MONITOR)", unit="req", file=sys.stderr)):
            rid = f"cmpl-stage-{i:04d}-{secrets.token_hex(4)}"
            client.headers["x-request-id"] = rid
            sent = time.time()
            ttft, _ = gateway_request(client, base, text, max_tokens)
            client_times.append((rid, sent, sent + ttft))
    control = redis.Redis.from_url(url)
    control.echo(marker)
    thread.join(10)
    control.close()
    monitor_client.close()

    stages = Stages()
    stages.unblocks = sum(c.upper().startswith("CLIENT UNBLOCK") for _, c in seen)
    for rid, sent, first_chunk in client_times:

        def at(prefix: str, rid: str = rid) -> float | None:
            return next((t for t, c in seen if c.startswith(prefix) and rid in c), None)

        exists = at(f"EXISTS {keys.output(rid)}")
        enqueued = at(f"XADD {keys.queue('')}")
        first_event = at(f"XADD {keys.output(rid)} ")
        marks = [sent, exists, enqueued, first_event, first_chunk]
        if all(m is not None for m in marks):
            points = [float(m) for m in marks if m is not None]
            stages.samples.append([b - a for a, b in itertools.pairwise(points)])
    return stages


def measure_floor(base: str, key: str, n: int) -> list[float]:
    """TTFT through the gateway to a load worker (first token at once, no model): the path's own cost."""
    headers = {"Authorization": f"Bearer {key}"}
    times: list[float] = []
    with httpx.Client(headers=headers, timeout=60) as client:
        texts = prompts(n + 10)
        for i, text in enumerate(
            tqdm(texts, desc="TTFT: gateway + load worker", unit="req", file=sys.stderr)
        ):
            ttft, _ = gateway_request(client, base, text, 1, model=LOAD_MODEL)
            if i >= 10:  # the first ones warm up
                times.append(ttft)
    return times


# -- 2. concurrent streams ---------------------------------------------------------------------------
@dataclass
class StreamTally:
    requested: int
    ok: int = 0
    open_now: int = 0
    peak_open: int = 0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)


async def read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """Yield the body chunks of an HTTP/1.1 `Transfer-Encoding: chunked` response."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


async def one_stream(
    port: int, request: bytes, tokens: int, delay_s: float, tally: StreamTally, bar: tqdm
) -> None:
    await asyncio.sleep(delay_s)
    start = time.perf_counter()
    writer: asyncio.StreamWriter | None = None
    opened = False
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            tally.errors[f"http {status}"] += 1
            return
        if b"transfer-encoding: chunked" not in head.lower():
            tally.errors["not chunked"] += 1
            return
        opened = True
        tally.open_now += 1
        tally.peak_open = max(tally.peak_open, tally.open_now)
        got, usage, done, buffer = 0, None, False, b""
        async for chunk in read_chunked(reader):
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    done = True
                    continue
                body = json.loads(event[6:])
                if "error" in body:
                    tally.errors[f"stream error: {body['error'].get('code')}"] += 1
                    return
                if body.get("usage"):
                    usage = body["usage"]["completion_tokens"]
                elif body["choices"][0]["text"]:
                    if got == 0:
                        tally.ttft_s.append(time.perf_counter() - start)
                    got += 1
                    tally.tokens += 1
        if got == tokens and usage == tokens and done:
            tally.ok += 1
        else:
            tally.errors["incomplete"] += 1
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        tally.errors[type(e).__name__] += 1
    finally:
        if opened:
            tally.open_now -= 1
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        bar.update(1)
        bar.set_postfix(open=tally.open_now, ok=tally.ok, refresh=False)


async def open_streams(
    port: int, key: str, streams: int, tokens: int, ramp_s: float, timeout_s: float
) -> StreamTally:
    """Open `streams` streaming requests, evenly over `ramp_s` (0: all at once), and tally them."""
    body = json.dumps(
        {
            "model": LOAD_MODEL,
            "prompt": "Stream a long answer, please.",
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    tally = StreamTally(streams)
    with tqdm(total=streams, desc=f"{streams} concurrent streams", unit="stream", file=sys.stderr) as bar:
        tasks = [
            asyncio.create_task(one_stream(port, request, tokens, ramp_s * i / streams, tally, bar))
            for i in range(streams)
        ]
        _, late = await asyncio.wait(tasks, timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            tally.errors["timeout"] += len(late)
        await asyncio.gather(*late, return_exceptions=True)
    return tally


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


class CPUMeter:
    """CPU seconds that child processes (by pid) and this process (the client) use from now on."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.before = [cpu_s(p) or 0.0 for p in pids]
        self.client_before = time.process_time()

    def used(self) -> list[float]:
        return [(cpu_s(p) or 0.0) - b for p, b in zip(self.pids, self.before, strict=True)]

    def client_used(self) -> float:
        return time.process_time() - self.client_before


@dataclass
class Sampler:
    """Peak RSS of a process, sampled in a thread while a phase runs."""

    pid: int
    peak_mb: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid) or 0.0)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[Sampler]:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()


# -- the run -------------------------------------------------------------------------------------------
Rows = list[tuple[str, str]]


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `with` blocks that stop the children


def table(rows: Rows) -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_gateway", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=100, help="sequential requests of the TTFT pass")
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
    wait_healthy(base, MODEL, procs)
    texts = prompts(args.requests + 10)
    measure_ttft(base, key, engine, texts[:10], args.ttft_tokens, "warm-up")
    run = measure_ttft(base, key, engine, texts[10:], args.ttft_tokens, "TTFT: gateway vs engine")
    paired = [g - e for g, e in zip(run.gateway_s, run.engine_s, strict=True)]
    out: dict[str, Any] = {
        "ttft_requests": len(run.gateway_s),
        "ttft_max_tokens": args.ttft_tokens,
        "gateway_ttft_p50_ms": ms(pct(run.gateway_s, 50)),
        "gateway_ttft_p99_ms": ms(pct(run.gateway_s, 99)),
        "engine_ttft_p50_ms": ms(pct(run.engine_s, 50)),
        "engine_ttft_p99_ms": ms(pct(run.engine_s, 99)),
        "engine_first_token_p50_ms": ms(pct(run.engine_first_token_s, 50)),
        "added_ttft_p50_ms": ms(pct(run.gateway_s, 50) - pct(run.engine_s, 50)),
        "added_ttft_p99_ms": ms(pct(run.gateway_s, 99) - pct(run.engine_s, 99)),
        "added_ttft_paired_p50_ms": ms(pct(paired, 50)),
        "ttft_outputs_match": run.mismatches == 0,
    }
    rows += [
        (
            "TTFT p50 / p99, gateway",
            f"{out['gateway_ttft_p50_ms']:.2f} / {out['gateway_ttft_p99_ms']:.2f} ms",
        ),
        (
            "TTFT p50 / p99, in-process engine",
            f"{out['engine_ttft_p50_ms']:.2f} / {out['engine_ttft_p99_ms']:.2f} ms",
        ),
        ("added TTFT p50 / p99", f"{out['added_ttft_p50_ms']:.2f} / {out['added_ttft_p99_ms']:.2f} ms"),
        ("added TTFT, median of pairs", f"{out['added_ttft_paired_p50_ms']:.2f} ms"),
        ("same text both ways", str(out["ttft_outputs_match"])),
    ]
    if args.stage_requests > 0:
        stages = measure_stages(base, key, url, texts[10 : 10 + args.stage_requests], args.ttft_tokens)
        split = {k: ms(pct([s[i] for s in stages.samples], 50)) for i, (k, _) in enumerate(STAGES)}
        out |= {"stages_p50_ms": split, "stages_requests": len(stages.samples)}
        out["stages_client_unblocks"] = stages.unblocks
        rows += [(f"p50 {text}", f"{split[k]:.3f} ms") for k, text in STAGES]
    procs.stop("gateway-ttft", "worker")
    return out


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
        floor = measure_floor(base, key, args.floor_requests)
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
            open_streams(port_of(base), key, args.streams, args.tokens, args.ramp_s, timeout_s)
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
