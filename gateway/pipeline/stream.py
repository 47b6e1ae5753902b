"""The streaming answer: the request's output events as OpenAI SSE chunks. Everything ready goes out in
one write: the events already relayed, and with the last one the usage chunk and `[DONE]`. A client
that goes away (or a stream that fails) cancels the request, freeing the worker's sequence.

Several choices (`sse_choices`): a chat stream opens with the assistant role of every index, then each
choice's chunks (one choice each, with its index) go out as they come, interleaved; after the last
choice's finish chunk, one usage chunk (if asked) and one `[DONE]`. A choice that fails ends the stream
with an error chunk, and the others are cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway import protocol
from gateway.choice_render import ChoiceRenderer, RenderSpec
from gateway.errors import APIError
from gateway.event_channel import ClientGone
from gateway.pipeline.fanout import ChoiceSet
from gateway.pipeline.output import OutputReader
from loragate.messages import OutputEvent

log = logging.getLogger(__name__)


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


def error_chunk(error: dict[str, Any]) -> str:
    """A worker's error as a stream's last chunk (its HTTP status is no part of it)."""
    return data({"error": {k: v for k, v in error.items() if k != "status"}})


def internal_error_chunk() -> str:
    """An unexpected failure while rendering, as a stream's last chunk (the stream has begun: no status)."""
    log.exception("unhandled error while streaming")
    return data(APIError(500, "Internal server error.", type_="server_error").body())


def event_chunks(answer: Answer, created: int, event: OutputEvent, choice: ChoiceRenderer) -> list[str]:
    """The SSE chunks of one output event of `choice` (none for an empty, not-last one)."""
    rid, model = answer.request_id, answer.model
    if event.error is not None:
        return [error_chunk(event.error)]
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
    event, done, failed = first, False, False
    parts: list[str] = []
    choice = ChoiceRenderer(answer.spec)
    if answer.chat:
        parts.append(
            data(protocol.chunk(answer.request_id, answer.model, created, True, [choice.role_chunk()]))
        )
    try:
        while True:
            try:
                parts += event_chunks(answer, created, event, choice)
            except Exception:  # a bug must not cut the stream: an error chunk, then [DONE]
                parts.append(internal_error_chunk())
                failed = True  # not done: the request is cancelled
                break
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
        done = event.is_last and not failed
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


async def sse_choices(
    answer: Answer, choices: ChoiceSet, watcher: asyncio.Future[None]
) -> AsyncIterator[str]:
    """The SSE chunks of several choices, as they come (see the module's docstring)."""
    rid, model, chat, created = answer.request_id, answer.model, answer.chat, int(time.time())
    renderers, last = choices.renderers(), dict[int, OutputEvent]()
    roles = [r.role_chunk() for r in renderers] if chat else []
    parts = [data(protocol.chunk(rid, model, created, True, [role])) for role in roles]
    try:
        while choices.left:
            try:
                index, event = await choices.next()
            except APIError as e:
                parts.append(data(e.body()))
                break
            except ClientGone:
                return
            if event.error is not None:
                parts.append(error_chunk(event.error))
                break
            try:
                rendered = renderers[index].feed(event)
            except Exception:  # a bug must not cut the stream: the others are cancelled by close()
                parts.append(internal_error_chunk())
                break
            for choice in rendered:
                parts.append(data(protocol.chunk(rid, model, created, chat, [choice])))
            if event.is_last:
                last[index] = event
            if parts and choices.left and not choices.ready():  # nothing more is ready: send before waiting
                yield "".join(parts)
                parts = []
        else:
            if answer.include_usage:
                parts.append(data(protocol.usage_chunk(rid, model, created, chat, choices.usage(last))))
        parts.append("data: [DONE]\n\n")
        yield "".join(parts)
    finally:
        watcher.cancel()
        await choices.close()  # every choice not ended (a failure, a client gone) is cancelled
