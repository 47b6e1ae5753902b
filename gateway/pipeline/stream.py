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
from gateway.choice_render import ChoiceRenderer, RenderSpec
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
    render: RenderSpec | None = None  # how its choices show (None: plain text)

    @property
    def spec(self) -> RenderSpec:
        return self.render or RenderSpec(self.chat)


def data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def event_chunks(answer: Answer, created: int, event: OutputEvent, choice: ChoiceRenderer) -> list[str]:
    """The SSE chunks of one output event of `choice` (none for an empty, not-last one)."""
    rid, model = answer.request_id, answer.model
    if event.error is not None:
        return [data({"error": {k: v for k, v in event.error.items() if k != "status"}})]
    parts = [data(protocol.chunk(rid, model, created, answer.chat, [c])) for c in choice.feed(event)]
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
    choice = ChoiceRenderer(answer.spec)
    if answer.chat:
        parts.append(
            data(protocol.chunk(answer.request_id, answer.model, created, True, [choice.role_chunk()]))
        )
    try:
        while True:
            parts += event_chunks(answer, created, event, choice)
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
