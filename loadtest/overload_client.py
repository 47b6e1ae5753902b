"""The overload benchmark's client (`loadtest.overload`): streaming completions over raw asyncio HTTP/1.1
(light, so the client leaves the CPU to the gateway), one new connection per request, open loop (Poisson
arrivals at a given rate, as independent users: a refusal does not slow the arrivals) or closed loop (a
fixed number of users, each sending its next request when the last one ends, to measure capacity).

Every request ends as one `Result`: admitted (200) with its TTFT and whether it streamed every token,
the usage chunk and `[DONE]`; refused with its status, error code and `Retry-After`; or an error of
another kind (connect timeout, reset, incomplete stream, timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from loadtest.gateway_streams import sse_chunks


@dataclass
class Result:
    sent_at: float  # monotonic
    status: int = 0  # 0: no HTTP response
    head_s: float = 0.0  # send → response head
    ttft_s: float | None = None  # send → first token (admitted)
    ended_at: float = 0.0
    tokens: int = 0
    ok: bool = False  # admitted and complete
    code: str | None = None  # the error's code (refused)
    retry_after_s: float | None = None
    error: str | None = None  # a failure other than an HTTP refusal


def completion_request(port: int, key: str, model: str, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "prompt": "Tell me a long story, please.",
            "max_tokens": tokens,
            "ignore_eos": True,  # every request is the same amount of work
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}


async def _stream(reader: asyncio.StreamReader, result: Result, tokens: int) -> None:
    usage, done = None, False
    async for events in sse_chunks(reader):
        for body in events:
            if body is None:
                done = True
                continue
            if "error" in body:
                result.error = f"stream error {body['error'].get('code')}"
                return
            if body.get("usage"):
                usage = body["usage"]["completion_tokens"]
            elif body["choices"][0]["text"]:
                if result.ttft_s is None:
                    result.ttft_s = time.monotonic() - result.sent_at
                result.tokens += 1
    # A real model's token can be an empty text chunk (part of a character): the usage chunk counts.
    result.ok = result.ttft_s is not None and usage == tokens and done
    if not result.ok:
        result.error = "incomplete stream"


async def one_request(port: int, request: bytes, tokens: int, timeout_s: float, connect_s: float) -> Result:
    result = Result(time.monotonic())
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(connect_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except (OSError, TimeoutError) as e:
        result.error = "connect timeout" if isinstance(e, TimeoutError) else f"connect {type(e).__name__}"
        result.ended_at = time.monotonic()
        return result
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            result.head_s = time.monotonic() - result.sent_at
            result.status = int(head.split(b" ", 2)[1])
            headers = _headers(head)
            if result.status == 200:
                await _stream(reader, result, tokens)
            else:
                body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))))
                result.code = body.get("error", {}).get("code")
                if "retry-after" in headers:
                    result.retry_after_s = float(headers["retry-after"])
    except TimeoutError:
        result.error = "timeout"
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        result.error = type(e).__name__
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    result.ended_at = time.monotonic()
    return result


@dataclass(frozen=True)
class Target:
    port: int
    request: bytes
    tokens: int
    timeout_s: float = 60.0
    connect_s: float = 5.0

    async def send(self) -> Result:
        return await one_request(self.port, self.request, self.tokens, self.timeout_s, self.connect_s)


async def open_loop(target: Target, rate_rps: float, duration_s: float, seed: int, desc: str) -> list[Result]:
    """Poisson arrivals at `rate_rps` for `duration_s`; waits for every request to end."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Result]] = []
    start = time.monotonic()
    with tqdm(total=round(rate_rps * duration_s), desc=desc, unit="req", leave=False) as bar:

        def finished(task: asyncio.Task[Result]) -> None:
            bar.update(1)

        due = start
        while (due := due + rng.expovariate(rate_rps)) < start + duration_s:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(target.send())
            task.add_done_callback(finished)
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


async def closed_loop(target: Target, users: int, duration_s: float, desc: str) -> list[Result]:
    """`users` users, each sending its next request as soon as the last ends (after a refusal: after its
    `Retry-After`, at most 1 s), for `duration_s`."""
    results: list[Result] = []
    end = time.monotonic() + duration_s

    async def user(bar: tqdm) -> None:
        while time.monotonic() < end:
            result = await target.send()
            results.append(result)
            bar.update(1)
            if not result.ok:
                await asyncio.sleep(min(1.0, result.retry_after_s or 0.1))

    with tqdm(desc=desc, unit="req", leave=False) as bar:
        await asyncio.gather(*(user(bar) for _ in range(users)))
    return results
