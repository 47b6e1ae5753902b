"""Concurrent streaming clients for `bench_serve`: `concurrency` asyncio clients over raw HTTP/1.1 (light,
to leave the 2 cores to the stack; `loadtest.gateway_streams.read_chunked`), each taking the next request
of the workload as soon as its previous one ended (a closed loop, as vLLM's `--max-concurrency`).

Per request: TTFT is send → the first SSE event with text; output tokens are the usage chunk's
`completion_tokens`; the inter-token latencies are the gaps between events with text. The gateway writes
everything that is ready in one HTTP chunk, so a chunk may carry several events (one per engine step): the
gap before a chunk of k events counts as k latencies of gap / k. A token whose text is held back (an
incomplete UTF-8 sequence) sends no event; its time goes to the next event's gap. A request refused with
429 is sent again after its `Retry-After` (as the `openai` SDK does; `refusals_429` counts them), its TTFT
counted from the first send. A request is an error when its status is not 200 (or still 429 after
`MAX_RETRIES`), its stream carries an error, or it ends without every token, the usage chunk or `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from loadtest.gateway_streams import send, sse_chunks
from loadtest.procs import ms, pct
from loragate.types import Request

MAX_RETRIES = 10
MAX_RETRY_AFTER_S = 30.0


@dataclass
class StreamStats:
    """What one request's stream showed."""

    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0  # the usage chunk's completion_tokens
    refusals: int = 0  # 429s before it was admitted
    prompt_tokens: int = 0  # the usage chunk's
    cached_tokens: int = 0  # the usage chunk's prompt_tokens_details.cached_tokens (prefix-cache hits)
    worker: str | None = None  # the response's x-loragate-worker header


def completion_body(request: Request, model: str) -> dict[str, Any]:
    """The workload request as a streamed completion: its prompt's token ids (no tokenization: the same
    work as offline), greedy, exactly `max_tokens` tokens (EOS ignored)."""
    name = f"{model}:{request.adapter}" if request.adapter else model
    return {
        "model": name,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.params.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def http_request(port: int, key: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + payload


async def stream_one(port: int, request: bytes, expected_tokens: int) -> StreamStats:
    """One request, sent again after a 429's `Retry-After` (as the `openai` SDK does) up to `MAX_RETRIES`
    times; its TTFT counts from the first send, the wait included."""
    stats = StreamStats()
    start = time.perf_counter()
    while True:
        retry_after = await _attempt(port, request, expected_tokens, stats, start)
        if retry_after is None or stats.refusals >= MAX_RETRIES:
            return stats
        stats.refusals += 1
        stats.error = None
        await asyncio.sleep(retry_after)


async def _attempt(
    port: int, request: bytes, expected_tokens: int, stats: StreamStats, start: float
) -> float | None:
    """Stream `request` into `stats`; the seconds to wait before retrying when refused with 429, else None."""
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer, head, status = await send(port, request)
        if status != 200:
            stats.error = f"http {status}"
            return _retry_after(head) if status == 429 else None
        stats.worker = _header(head, b"x-loragate-worker")
        last, done = start, False
        async for events in sse_chunks(reader):
            now = time.perf_counter()
            texts = 0
            for body in events:
                if body is None:
                    done = True
                    continue
                if "error" in body:
                    stats.error = f"stream error: {body['error'].get('code')}"
                    return None
                if usage := body.get("usage"):
                    stats.tokens = int(usage["completion_tokens"])
                    stats.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    stats.cached_tokens = int(
                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    )
                texts += sum(1 for c in body.get("choices", ()) if c.get("text"))
            if texts and stats.ttft_s is None:
                stats.ttft_s = now - start
            elif texts:
                stats.itl_s += [(now - last) / texts] * texts
            if texts:
                last = now
        if not done or stats.tokens != expected_tokens or stats.ttft_s is None:
            stats.error = "incomplete"
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError) as e:
        stats.error = type(e).__name__
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    return None


def _header(head: bytes, name: bytes) -> str | None:
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode()
    return None


def _retry_after(head: bytes) -> float:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"retry-after":
            with contextlib.suppress(ValueError):
                return min(MAX_RETRY_AFTER_S, max(0.0, float(value)))
    return 1.0


async def run_clients(
    port: int, key: str, model: str, requests: list[Request], concurrency: int, label: str
) -> tuple[list[StreamStats], float]:
    """Every request, by `concurrency` clients; the results in the workload's order and the wall time."""
    prepared = [(http_request(port, key, completion_body(r, model)), r.params.max_tokens) for r in requests]
    results: list[StreamStats] = [StreamStats() for _ in requests]
    order: Iterator[int] = iter(range(len(requests)))  # shared: each client takes the next index

    async def client(bar: tqdm) -> None:
        for i in order:
            results[i] = await stream_one(port, *prepared[i])
            bar.update(1)

    with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr) as bar:
        start = time.perf_counter()
        await asyncio.gather(*(client(bar) for _ in range(min(concurrency, len(requests)))))
        wall = time.perf_counter() - start
    return results, wall


def ttft_waves(ttft_s: Sequence[float | None], first_wave: int, prefix: str = "ttft") -> dict[str, float]:
    """TTFT of the first wave (the first `first_wave` requests, sent together when the clients start: a
    burst the engine prefills in turn, so its last first token comes after all of its prompts are
    computed) apart from the rest (each sent as another ends: steady state), in ms. With closed-loop
    clients a level's overall p99 is the first wave's tail and its p50 sits where the waves meet."""
    first = [t for t in ttft_s[:first_wave] if t is not None]
    rest = [t for t in ttft_s[first_wave:] if t is not None]
    return {
        f"{prefix}_first_wave_p50_ms": ms(pct(first, 50)),
        f"{prefix}_first_wave_max_ms": ms(max(first, default=float("nan"))),
        f"{prefix}_rest_p50_ms": ms(pct(rest, 50)),
        f"{prefix}_rest_p99_ms": ms(pct(rest, 99)),
    }


def summarize(
    results: list[StreamStats],
    wall_s: float,
    offline_tok_s: float | None = None,
    all_at_once_tok_s: float | None = None,
    first_wave: int = 0,
) -> dict[str, Any]:
    """The figures of one concurrency level (the keys issue 15 names, and a few for context); those that
    compare with the offline engine only when its figures are given; with `first_wave` (the number of
    clients: `results` in the order they were sent) the TTFT of the first wave and of the rest."""
    tokens = sum(r.tokens for r in results)
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    itl = [gap for r in results for gap in r.itl_s]
    per_request = [sum(r.itl_s) / len(r.itl_s) for r in results if r.itl_s]
    serve_tok_s = tokens / wall_s
    errors = Counter(r.error for r in results if r.error is not None)
    offline = (
        {
            "offline_tok_s": round(offline_tok_s, 1),
            "serve_vs_offline": round(serve_tok_s / offline_tok_s, 3),
            "serve_vs_offline_all_at_once": round(serve_tok_s / all_at_once_tok_s, 3),
        }
        if offline_tok_s and all_at_once_tok_s
        else {}
    )
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "serve_tok_s": round(serve_tok_s, 1),
        **offline,
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p99_ms": ms(pct(ttft, 99)),
        "itl_p50_ms": ms(pct(itl, 50)),
        "itl_p99_ms": ms(pct(itl, 99)),
        "tpot_p50_ms": ms(pct(per_request, 50)),
        "errors": sum(errors.values()),
        "refusals_429": sum(r.refusals for r in results),
        "error_kinds": dict(errors),
        **(ttft_waves([r.ttft_s for r in results], first_wave) if first_wave else {}),
    }
