"""Many concurrent streaming requests from one light asyncio HTTP/1.1 client (`bench_gateway`): how many
streams one gateway process holds open at once, each ok only when it got every token, the usage chunk
and `[DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm


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


async def send(port: int, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes, int]:
    """Send a raw HTTP request to the gateway on 127.0.0.1: (reader, writer, response head, status)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head, int(head.split(b" ", 2)[1])


async def sse_chunks(reader: asyncio.StreamReader) -> AsyncIterator[list[dict[str, Any] | None]]:
    """Per body chunk of a chunked server-sent-events response, the `data:` events it completes: each a
    JSON object, or None for `[DONE]` (an event split across chunks comes with the chunk that ends it)."""
    buffer = b""
    async for chunk in read_chunked(reader):
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        yield [None if e == b"data: [DONE]" else json.loads(e[6:]) for e in events if e.startswith(b"data: ")]


async def one_stream(
    port: int, request: bytes, tokens: int, delay_s: float, tally: StreamTally, bar: tqdm
) -> None:
    await asyncio.sleep(delay_s)
    start = time.perf_counter()
    writer: asyncio.StreamWriter | None = None
    opened = False
    try:
        reader, writer, head, status = await send(port, request)
        if status != 200:
            tally.errors[f"http {status}"] += 1
            return
        if b"transfer-encoding: chunked" not in head.lower():
            tally.errors["not chunked"] += 1
            return
        opened = True
        tally.open_now += 1
        tally.peak_open = max(tally.peak_open, tally.open_now)
        got, usage, done = 0, None, False
        async for events in sse_chunks(reader):
            for body in events:
                if body is None:
                    done = True
                    continue
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
    port: int, key: str, model: str, streams: int, tokens: int, ramp_s: float, timeout_s: float
) -> StreamTally:
    """Open `streams` streaming requests, evenly over `ramp_s` (0: all at once), and tally them."""
    body = json.dumps(
        {
            "model": model,
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
