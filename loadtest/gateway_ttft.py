"""TTFT through the gateway against TTFT of an in-process engine, request by request (`bench_gateway`).

Each prompt goes once through an `LLMEngine` in this process and once through the gateway from a minimal
raw-socket client (`loadtest.sse_client`), and, for reference, once more through httpx, the order rotating
so that drifts in machine load hit every path alike. The raw client isolates what the gateway + Redis +
worker-loop path adds; the httpx figure shows what a typical Python client sees on top.
"""

from __future__ import annotations

import itertools
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import httpx
import redis
from tqdm import tqdm

from gateway.tokenize import load_tokenizer
from loadtest.procs import BenchError
from loadtest.sse_client import SSEClient
from loragate import contracts
from loragate.types import Request, SamplingParams
from worker.engine import LLMEngine

TOPICS = ("cats", "rivers", "compilers", "tea", "glaciers", "chess", "bread", "comets", "jazz", "moss")


def prompts(n: int) -> list[str]:
    return [f"Note {i} on {TOPICS[i % len(TOPICS)]}: write two short lines about it." for i in range(n)]


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def raw_request(
    client: SSEClient, model: str, prompt: str, max_tokens: int, headers: dict[str, str] | None = None
) -> tuple[float, str]:
    """Seconds from sending to the first SSE content chunk, and the whole text (raw-socket client)."""
    result = client.stream(
        client.request("/v1/completions", completion_body(model, prompt, max_tokens), headers)
    )
    if result.status != 200:
        raise BenchError(f"gateway answered {result.status}: {result.events}")
    if any("error" in e for e in result.events):
        raise BenchError(f"stream error: {result.events}")
    if result.ttft_s is None or not result.done:
        raise BenchError("the stream ended without content or [DONE]")
    return result.ttft_s, result.text


def httpx_request(
    client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, str]:
    """The same through httpx: seconds to the first content chunk, and the whole text."""
    first: float | None = None
    pieces: list[str] = []
    done = False
    start = time.perf_counter()
    with client.stream(
        "POST", f"{base}/v1/completions", json=completion_body(model, prompt, max_tokens)
    ) as resp:
        if resp.status_code != 200:
            raise BenchError(f"gateway answered {resp.status_code}: {resp.read().decode(errors='replace')}")
        for line in resp.iter_lines():
            now = time.perf_counter()
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if first is None and (choice["text"] or choice["finish_reason"]):
                first = now - start
            pieces.append(choice["text"])
    if first is None or not done:
        raise BenchError("the stream ended without content or [DONE]")
    return first, "".join(pieces)


def engine_request(engine: LLMEngine, rid: str, ids: list[int], max_tokens: int) -> tuple[float, str]:
    """Seconds from `add_request` to the first output the gateway would relay as content, and the text."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first: float | None = None
    pieces: list[str] = []
    start = time.perf_counter()
    engine.add_request(Request(rid, tuple(ids), params))
    while engine.has_work():
        for out in engine.step():
            if first is None and (out.text_delta or out.finished):
                first = time.perf_counter() - start
            pieces.append(out.text_delta)
    assert first is not None
    return first, "".join(pieces)


@dataclass
class TTFTRun:
    gateway_s: list[float] = field(default_factory=list)  # raw-socket client
    httpx_s: list[float] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    mismatches: int = 0  # requests whose text differed between the paths


def measure_ttft(
    base: str,
    key: str,
    model: str,
    engine: LLMEngine,
    texts: list[str],
    max_tokens: int,
    label: str,
    warm: bool = False,
) -> TTFTRun:
    """Each text through every path, the order rotating, so each path runs right after the others (which
    evict its code and weights from the CPU caches: on a 2-core machine the gateway, Redis, the worker and
    this process share them) and every path meets the same conditions.

    With `warm`, each path first serves another prompt, unmeasured, right before the measured one. That
    favours the in-process engine: it then runs back to back, while the worker has idled during the
    request's trip through the gateway (an idle gap alone slows this machine's next engine step: about
    0.25 ms after 2 ms idle), so it is reported as a second view only."""
    tok = load_tokenizer(engine.info.model_dir)
    run = TTFTRun()
    headers = {"Authorization": f"Bearer {key}"}
    with SSEClient.for_url(base, headers) as raw, httpx.Client(headers=headers, timeout=60) as client:
        for i, text in enumerate(tqdm(texts, desc=label, unit="req", file=sys.stderr)):
            aside = f"Aside {i}: {TOPICS[(i + 3) % len(TOPICS)]}, briefly."
            order = [
                (run.engine_s, partial(_engine_path, engine, tok.encode, f"{label}-{i}", max_tokens)),
                (run.gateway_s, partial(raw_request, raw, model, max_tokens=max_tokens)),
                (run.httpx_s, partial(httpx_request, client, base, model, max_tokens=max_tokens)),
            ]
            shift = i % len(order)  # rotate which path goes first
            texts_out = set()
            for times, call in order[shift:] + order[:shift]:
                if warm:
                    call(prompt=aside)
                seconds, out = call(prompt=text)
                times.append(seconds)
                texts_out.add(out)
            run.mismatches += len(texts_out) != 1
    return run


def _engine_path(
    engine: LLMEngine, encode: Callable[[str], list[int]], rid: str, max_tokens: int, prompt: str
) -> tuple[float, str]:
    return engine_request(engine, f"{rid}-{secrets.token_hex(3)}", encode(prompt), max_tokens)


# Stages of one gateway request, between Redis MONITOR timestamps of its commands and the client's clock.
STAGES = (
    ("http_in_and_handler", "client send → gateway's EXISTS (HTTP in, auth, parse, tokenize)"),
    ("gateway_enqueue", "EXISTS → XADD lg:q (admission, routing, subscribe, one pipeline)"),
    ("worker", "XADD lg:q → XADD lg:out (XREADGROUP wakes, add_request, engine step, publish)"),
    ("relay_out", "XADD lg:out → first SSE chunk at the client (mux, handler, HTTP out)"),
)


@dataclass
class Stages:
    samples: list[list[float]] = field(default_factory=list)  # per request: seconds per stage
    unblocks: int = 0  # CLIENT UNBLOCKs the gateway's output relay needed


def measure_stages(base: str, key: str, url: str, model: str, texts: list[str], max_tokens: int) -> Stages:
    """Gateway requests with Redis MONITOR on: where the time between send and first chunk goes. The
    requests carry `X-Request-Id`, so the gateway checks for a retry first (`EXISTS`): that marks the end
    of the first stage."""
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
    with SSEClient.for_url(base, {"Authorization": f"Bearer {key}"}) as raw:
        for i, text in enumerate(tqdm(texts, desc="stage split (MONITOR)", unit="req", file=sys.stderr)):
            rid = f"cmpl-stage-{i:04d}-{secrets.token_hex(4)}"
            sent = time.time()
            ttft, _ = raw_request(raw, model, text, max_tokens, {"X-Request-Id": rid})
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

        # Keys carry the tenant-scoped id (`{tenant tag}/{rid}`): match the command and the client's id.
        exists = at(f"EXISTS {contracts.PREFIX}:out:")
        enqueued = at(f"XADD {contracts.PREFIX}:q:")  # in the enqueue script (MONITOR shows its commands)
        first_event = at(f"XADD {contracts.PREFIX}:out:")
        marks = [sent, exists, enqueued, first_event, first_chunk]
        if all(m is not None for m in marks):
            points = [float(m) for m in marks if m is not None]
            stages.samples.append([b - a for a, b in itertools.pairwise(points)])
    return stages


def measure_floor(base: str, key: str, model: str, n: int) -> list[float]:
    """TTFT through the gateway to a load worker (first token at once, no model): the path's own cost."""
    times: list[float] = []
    with SSEClient.for_url(base, {"Authorization": f"Bearer {key}"}) as raw:
        texts = prompts(n + 10)
        for i, text in enumerate(
            tqdm(texts, desc="TTFT: gateway + load worker", unit="req", file=sys.stderr)
        ):
            ttft, _ = raw_request(raw, model, text, 1)
            if i >= 10:  # the first ones warm up
                times.append(ttft)
    return times
