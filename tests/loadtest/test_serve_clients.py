"""`loadtest.serve_clients` against a scripted HTTP server on loopback: a 429 is retried after its
`Retry-After` and counted; tokens, TTFT and inter-token latencies come from the SSE events (several events
in one HTTP chunk share its gap); a stream short of its tokens is an error."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from loadtest.serve_clients import StreamStats, stream_one, summarize

REFUSED = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 0\r\nContent-Length: 0\r\n\r\n"


def sse(*bodies: dict[str, object] | str) -> bytes:
    return b"".join(f"data: {b if isinstance(b, str) else json.dumps(b)}\n\n".encode() for b in bodies)


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def text(piece: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": piece, "finish_reason": None}]}


async def serve_script(responses: list[list[bytes]]) -> StreamStats:
    """Answer the n-th connection with responses[n] (its writes 20 ms apart), and stream one request."""
    seen = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.startswith(b"Content-Length"))
        await reader.readexactly(length)
        writes, seen = responses[seen], seen + 1
        try:
            for data in writes:
                writer.write(data)
                await writer.drain()
                await asyncio.sleep(0.02)
        except ConnectionError:
            pass  # the client stopped reading early (an error event)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        request = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
        return await stream_one(port, request, expected_tokens=3)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
USAGE = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


@pytest.mark.timeout(30)
def test_a_refused_request_is_sent_again_and_measured() -> None:
    stream = [
        STREAM_HEAD,
        chunk(sse(text("a"))),
        chunk(sse(text("b"), text("c"), USAGE, "[DONE]")),  # two tokens in one write
        b"0\r\n\r\n",
    ]
    stats = asyncio.run(serve_script([[REFUSED], stream]))
    assert (stats.error, stats.refusals, stats.tokens) == (None, 1, 3)
    assert stats.ttft_s is not None and stats.ttft_s > 0
    assert len(stats.itl_s) == 2 and stats.itl_s[0] == stats.itl_s[1] > 0.005  # the 20 ms gap, halved


@pytest.mark.timeout(30)
def test_a_stream_short_of_its_tokens_is_an_error() -> None:
    short = {**USAGE, "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    stream = [STREAM_HEAD, chunk(sse(text("a"), short, "[DONE]")), b"0\r\n\r\n"]
    stats = asyncio.run(serve_script([stream]))
    assert (stats.error, stats.refusals, stats.tokens) == ("incomplete", 0, 1)


@pytest.mark.timeout(30)
def test_an_error_event_ends_the_request() -> None:
    stream = [STREAM_HEAD, chunk(sse(text("a"), {"error": {"code": "boom"}})), b"0\r\n\r\n"]
    stats = asyncio.run(serve_script([stream]))
    assert stats.error == "stream error: boom"


@pytest.mark.timeout(10)
def test_the_first_wave_of_ttft_is_reported_apart_from_the_rest() -> None:
    """The first `first_wave` results (sent at once) and the rest (sent as others ended) are split; a
    request that never saw a token counts in neither."""
    ttfts = [1.0, 0.9, None, 0.1, 0.3, 0.2]
    results = [StreamStats(ttft_s=t, tokens=4, error=None if t else "cut") for t in ttfts]
    level = summarize(results, wall_s=2.0, first_wave=3)
    assert level["ttft_first_wave_p50_ms"] == pytest.approx(950)
    assert level["ttft_first_wave_max_ms"] == pytest.approx(1000)
    assert level["ttft_rest_p50_ms"] == pytest.approx(200)
    assert level["ttft_rest_p99_ms"] == pytest.approx(298)
    assert level["ttft_p99_ms"] == pytest.approx(996)  # the overall tail is the first wave's
    assert "ttft_first_wave_p50_ms" not in summarize(results, wall_s=2.0)
