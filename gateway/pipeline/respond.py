"""Stage respond: wait for the request's first output event (so an error the worker finds still gets a
proper status), then answer: an SSE stream, or one JSON body collected from every event. From the
moment it is enqueued a client that goes away cancels its request, even while it still waits in a
queue; `finish` and `cancel` end this handler's part on every path. A request of several choices
(`respond_choices`) answers the same way once every prompt's first choice has its first event, with its
choices in index order (or, streamed, interleaved as they come: `gateway.pipeline.stream`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from gateway import protocol
from gateway.choice_render import ChoiceRenderer
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.event_channel import ClientGone, EventChannel
from gateway.pipeline.admit import client_closed
from gateway.pipeline.fanout import ChoiceSet, worker_error
from gateway.pipeline.output import OutputReader
from gateway.pipeline.stream import Answer, sse, sse_choices
from gateway.sse import EventStreamResponse
from loragate.messages import OutputEvent

Done = Callable[[OutputEvent, float], None]  # (last event, monotonic time of the first)


async def respond(
    ctx: GatewayContext,
    request: Request,
    answer: Answer,
    stream: bool,
    reader: OutputReader,
    done: Done,
    headers: dict[str, str],
) -> Response:
    watcher = asyncio.ensure_future(watch(request.receive, reader.events))
    try:
        first = await first_event(reader, ctx.settings.first_event_timeout_s)
        first_at = time.monotonic()

        def finished(event: OutputEvent) -> None:
            done(event, first_at)

        headers["x-loragate-worker"] = first.worker_id
        if stream:
            chunks = sse(answer, first, reader, ctx.settings.request_timeout_s, finished, watcher)
            return EventStreamResponse(chunks, headers)
    except BaseException:
        watcher.cancel()
        raise
    try:
        return await collect(answer, first, reader, ctx.settings.request_timeout_s, finished, headers)
    finally:
        watcher.cancel()


class Watched(Protocol):
    def client_gone(self) -> None: ...


async def watch(receive: Receive, events: EventChannel | Watched) -> None:
    """Tell the request's channel (or its choices) when its client disconnects (ASGI `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    events.client_gone()


async def first_event(reader: OutputReader, timeout_s: float) -> OutputEvent:
    """The first output event; its prompt no longer waits on the worker then, whatever came."""
    try:
        first = await reader.next(timeout_s)
    except (APIError, ClientGone) as e:
        await reader.cancel()
        raise e if isinstance(e, APIError) else client_closed() from None
    except BaseException:  # cancelled (the server stops) or unexpected: what it holds is given back
        reader.finish()
        raise
    finally:
        reader.first_token()
    if first.error is not None:
        reader.finish()
        err = first.error
        again = {"Retry-After": "2"} if err.get("status") == 503 else None  # e.g. lost with Redis
        status, message = int(err.get("status", 400)), str(err.get("message"))
        raise APIError(status, message, code=err.get("code"), headers=again)
    return first


async def collect(
    answer: Answer,
    first: OutputEvent,
    reader: OutputReader,
    timeout_s: float,
    on_done: Callable[[OutputEvent], None],
    headers: dict[str, str],
) -> Response:
    choice = ChoiceRenderer(answer.spec)
    event = first
    try:
        choice.feed(first)
        while not event.is_last:
            event = await reader.next(timeout_s)
            if event.error is not None:
                err = event.error
                raise APIError(int(err.get("status", 500)), str(err.get("message")), code=err.get("code"))
            choice.feed(event)
    except (APIError, asyncio.CancelledError):
        await reader.cancel()
        raise
    except ClientGone:
        await reader.cancel()
        raise client_closed() from None
    except BaseException:  # unexpected (e.g. while rendering): the request ends here, its worker too
        await reader.cancel()
        raise
    reader.finish()
    on_done(event)
    use = protocol.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
    body = protocol.body(answer.request_id, answer.model, answer.chat, [choice.final()], use)
    return JSONResponse(body, headers=headers)


async def respond_choices(
    ctx: GatewayContext,
    request: Request,
    answer: Answer,
    stream: bool,
    choices: ChoiceSet,
    headers: dict[str, str],
) -> Response:
    """`respond` for a request of several choices (started here)."""
    choices.start()
    watcher = asyncio.ensure_future(watch(request.receive, choices))
    try:
        first = await choices.opened()
        headers["x-loragate-worker"] = first.worker_id
        if choices.decision_id is not None:
            headers["x-loragate-decision"] = choices.decision_id
        if stream:
            return EventStreamResponse(sse_choices(answer, choices, watcher), headers)
    except BaseException:
        watcher.cancel()
        await choices.close()
        raise
    try:
        return await collect_choices(answer, choices, headers)
    finally:
        watcher.cancel()


async def collect_choices(answer: Answer, choices: ChoiceSet, headers: dict[str, str]) -> Response:
    """One JSON body of every choice, in index order; any choice's failure fails it (the others are
    cancelled)."""
    renderers, last = choices.renderers(), dict[int, OutputEvent]()
    try:
        while choices.left:
            index, event = await choices.next()
            if event.error is not None:
                raise worker_error(event.error, 500)
            renderers[index].feed(event)
            if event.is_last:
                last[index] = event
    except ClientGone:
        await choices.close()
        raise client_closed() from None
    except BaseException:
        await choices.close()
        raise
    use = choices.usage(last)
    body = protocol.body(answer.request_id, answer.model, answer.chat, [r.final() for r in renderers], use)
    return JSONResponse(body, headers=headers)
