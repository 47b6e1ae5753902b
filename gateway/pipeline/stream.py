"""The streaming answer: the request's output events as OpenAI SSE chunks. Everything ready goes out in
one write: the events already relayed, and with the last one the usage chunk and `[DONE]`. A client
that goes away (or a stream that fails) cancels the request, freeing the worker's sequence."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway import protocol
from gateway.errors import APIError
from gateway.pipeline.output import OutputReader
from gateway.relay import ClientGone
from loragate.messages import OutputEvent


@dataclass(frozen=True)
class Answer:
    """How the answer is labelled: the client's request id, the model named, the endpoint."""

    request_id: str
    model: str
    chat: bool
    include_usage: bool = False


def data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def event_chunks(answer: Answer, created: int, event: OutputEvent) -> list[str]:
    """The SSE chunks of one output event (none for an empty, not-last one)."""
    rid, model = answer.request_id, answer.model
    if event.error is not None:
        return [data({"error": {k: v for k, v in event.error.items() if k != "status"}})]
    parts: list[str] = []
    if event.text or event.is_last:
        finish = event.finish_reason
        delta = {"content": event.text} if event.text else {}
        chunk = (
            protocol.chat_chunk(rid, model, created, delta, finish)
            if answer.chat
            else protocol.completion_chunk(rid, model, created, event.text, finish)
        )
        parts.append(data(chunk))
    if event.is_last and answer.include_usage:
        use = protocol.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        parts.append(data(protocol.usage_chunk(rid, model, created, answer.chat, use)))
    return parts


async def sse(
    answer: Answer,
    first: OutputEvent,
    reader: OutputReader,
    timeout_s: float,
    on_done: Callable[[OutputEvent], None],
    watcher: asyncio.Future[None],
) -> AsyncIterator[str]:
    created = int(time.time())
    event, done = first, False
    parts: list[str] = []
    if answer.chat:
        role = {"role": "assistant", "content": ""}
        parts.append(data(protocol.chat_chunk(answer.request_id, answer.model, created, role, None)))
    try:
        while True:
            parts += event_chunks(answer, created, event)
            if event.error is not None or event.is_last:
                break
            if parts and not len(reader.events):  # nothing more is ready: send before waiting
                yield "".join(parts)
                parts = []
            try:
                event = await reader.next(timeout_s)
            except APIError as e:
                parts.append(data(e.body()))
                break
            except ClientGone:
                return
        done = event.is_last
        if done:
            on_done(event)
        parts.append("data: [DONE]\n\n")
        yield "".join(parts)
    finally:
        watcher.cancel()
        if done:
            reader.finish()
        else:  # the client went away (or the stream failed): free the worker's sequence
            await reader.cancel()
