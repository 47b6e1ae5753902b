"""EventStreamResponse: the head (event-stream, no-cache, the caller's headers), one body message per
chunk, then the end; it never reads from the client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Message

from gateway.sse import EventStreamResponse


async def _chunks(*texts: str) -> AsyncIterator[str]:
    for text in texts:
        yield text


def _send_all(response: EventStreamResponse) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        raise AssertionError("the response must not read from the client")

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(response({"type": "http"}, receive, send))
    return sent


def _headers(message: dict[str, Any]) -> dict[bytes, bytes]:
    return dict(message["headers"])


def test_streams_each_chunk_then_ends() -> None:
    sent = _send_all(EventStreamResponse(_chunks("data: 1\n\n", "data: é\n\n"), {"x-loragate-worker": "w1"}))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    head = _headers(sent[0])
    assert head[b"content-type"].startswith(b"text/event-stream")
    assert head[b"cache-control"] == b"no-cache" and head[b"x-loragate-worker"] == b"w1"
    assert sent[1:] == [
        {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True},
        {"type": "http.response.body", "body": "data: é\n\n".encode(), "more_body": True},
        {"type": "http.response.body", "body": b"", "more_body": False},
    ]


def test_no_chunks_is_a_head_and_an_end() -> None:
    sent = _send_all(EventStreamResponse(_chunks()))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["more_body"] is False


def test_callers_cache_control_wins() -> None:
    sent = _send_all(EventStreamResponse(_chunks(), {"cache-control": "no-store"}))
    assert _headers(sent[0])[b"cache-control"] == b"no-store"
