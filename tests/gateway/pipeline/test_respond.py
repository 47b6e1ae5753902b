"""Stage respond on a real Redis: the first event decides the status (a worker's error keeps its own,
with `Retry-After` on 503), its prompt stops counting as queued whatever came, and the answer (one JSON
body, or SSE chunks) ends the handler's part exactly once."""

from __future__ import annotations

import asyncio
import json
from unittest import mock

import pytest

from gateway.choice_render import ChoiceRenderer
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.admit import Charge
from gateway.pipeline.enqueue import enqueue
from gateway.pipeline.output import OutputReader
from gateway.pipeline.respond import collect, first_event, respond
from gateway.pipeline.route import route, route_input
from gateway.pipeline.stream import Answer, sse
from loragate.messages import OutputEvent
from policies.routing_state import Phase
from tests.gateway.pipeline.live_context import BASE, TENANT, http_request, job, prompt, put, resolved, run

ANSWER = Answer("req-00000001", BASE, chat=False, include_usage=True)


async def queued(ctx: GatewayContext) -> OutputReader:
    j = job(ctx)
    charge = Charge(ctx.admission, TENANT, BASE, 1.0)
    decision, reservation = route(ctx, route_input(j, resolved(ctx), prompt(40)), charge)
    return await enqueue(ctx, j, decision, reservation, charge)


def phase(reader: OutputReader) -> Phase:
    assert reader.reservation is not None
    return reader.reservation.phase


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [({"status": 503, "message": "lost"}, 503, "2"), ({"message": "bad adapter"}, 400, None)],
    ids=["503 says when to retry", "status defaults to 400"],
)
def test_a_first_event_error_keeps_its_status(
    error: dict[str, object], status: int, retry_after: str | None, redis_url: str
) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader = await queued(ctx)
        await put(ctx.redis, reader.job.qid, OutputEvent(error=error, finish_reason="error"))
        with pytest.raises(APIError) as e:
            await first_event(reader, 5)
        assert e.value.status == status and e.value.headers.get("Retry-After") == retry_after
        assert phase(reader) is Phase.RELEASED and ctx.router.state.queued_tokens == {}

    run(redis_url, body)


def test_no_first_event_in_time_is_504_and_cancels(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader = await queued(ctx)
        with pytest.raises(APIError) as e:
            await first_event(reader, 0.05)
        assert e.value.status == 504 and phase(reader) is Phase.RELEASED
        assert sum(w.queue_len for w in ctx.fleet.workers.values()) == 0

    run(redis_url, body)


def test_a_handler_cancelled_while_waiting_for_its_first_event_gives_back_what_it_holds(
    redis_url: str,
) -> None:
    """The server stops (or anything unexpected happens) while the handler waits: its reservation is
    released and it stops relaying, not left counted on the worker until the next fleet refresh."""

    async def body(ctx: GatewayContext) -> None:
        reader = await queued(ctx)
        waiting = asyncio.ensure_future(first_event(reader, 30))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert phase(reader) is Phase.RELEASED and ctx.router.state.queued_tokens == {}
        assert sum(w.queue_len for w in ctx.fleet.workers.values()) == 0

    run(redis_url, body)


def test_the_first_token_frees_the_queued_prompt(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader = await queued(ctx)
        await put(ctx.redis, reader.job.qid, OutputEvent(token_ids=(5,), text="a", completion_tokens=1))
        assert (await first_event(reader, 5)).text == "a"
        assert phase(reader) is Phase.PREFILLED and ctx.router.state.queued_tokens == {}

    run(redis_url, body)


def test_collect_joins_the_text_and_finishes_once(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader, done = await queued(ctx), []
        for i, text in enumerate("ab"):
            await put(ctx.redis, reader.job.qid, OutputEvent((i,), text, completion_tokens=i + 1))
        await put(ctx.redis, reader.job.qid, OutputEvent(text="c", finish_reason="stop", completion_tokens=3))
        first = await first_event(reader, 5)
        response = await collect(ANSWER, first, reader, 5, done.append, {})
        assert json.loads(bytes(response.body))["choices"][0]["text"] == "abc"
        assert [e.text for e in done] == ["c"] and phase(reader) is Phase.RELEASED

    run(redis_url, body)


def test_an_error_while_collecting_cancels(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader, done = await queued(ctx), []
        await put(ctx.redis, reader.job.qid, OutputEvent((1,), "a", completion_tokens=1))
        await put(ctx.redis, reader.job.qid, OutputEvent(error={"message": "boom"}, finish_reason="error"))
        first = await first_event(reader, 5)
        with pytest.raises(APIError) as e:
            await collect(ANSWER, first, reader, 5, done.append, {})
        assert e.value.status == 500 and done == [] and phase(reader) is Phase.RELEASED

    run(redis_url, body)


def test_sse_streams_every_chunk_then_done(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader, done = await queued(ctx), []
        await put(ctx.redis, reader.job.qid, OutputEvent((1,), "a", completion_tokens=1))
        await put(ctx.redis, reader.job.qid, OutputEvent(text="b", finish_reason="stop", completion_tokens=2))
        first = await first_event(reader, 5)
        watcher = asyncio.ensure_future(asyncio.sleep(3600))
        out = "".join([chunk async for chunk in sse(ANSWER, first, reader, 5, done.append, watcher)])
        await asyncio.sleep(0)
        assert out.count("data: ") == 4 and out.endswith("data: [DONE]\n\n")  # a, b, usage, [DONE]
        assert [e.text for e in done] == ["b"] and phase(reader) is Phase.RELEASED and watcher.cancelled()

    run(redis_url, body)


def test_respond_answers_with_the_worker_header(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader, done = await queued(ctx), []
        last = OutputEvent(text="hi", finish_reason="stop", completion_tokens=1, worker_id="w-x")
        await put(ctx.redis, reader.job.qid, last)
        response = await respond(
            ctx, http_request(), ANSWER, False, reader, lambda e, t: done.append(t), {"x-request-id": "r"}
        )
        assert response.headers["x-loragate-worker"] == "w-x" and response.headers["x-request-id"] == "r"
        assert len(done) == 1 and phase(reader) is Phase.RELEASED

    run(redis_url, body)


def broken_renderer() -> mock._patch[mock.MagicMock]:
    """A rendering bug: every event fed to a choice raises."""
    return mock.patch.object(ChoiceRenderer, "feed", side_effect=RuntimeError("bug"))


@pytest.mark.parametrize("first_fails", [True, False], ids=["on the first event", "on a later event"])
def test_an_unexpected_error_while_collecting_cancels(redis_url: str, first_fails: bool) -> None:
    """A bug while rendering still ends the request: its worker is told to stop and what it holds is
    given back (not left reserved while the error becomes a 500)."""

    async def body(ctx: GatewayContext) -> None:
        reader, done = await queued(ctx), []
        await put(ctx.redis, reader.job.qid, OutputEvent((1,), "a", completion_tokens=1))
        await put(ctx.redis, reader.job.qid, OutputEvent(text="b", finish_reason="stop", completion_tokens=2))
        first = await first_event(reader, 5)
        fails = [RuntimeError("bug")] if first_fails else [[], RuntimeError("bug")]
        with mock.patch.object(ChoiceRenderer, "feed", side_effect=fails), pytest.raises(RuntimeError):
            await collect(ANSWER, first, reader, 5, done.append, {})
        assert done == [] and phase(reader) is Phase.RELEASED

    run(redis_url, body)


def test_an_unexpected_error_while_streaming_is_an_error_chunk_and_cancels(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        reader, done = await queued(ctx), []
        await put(ctx.redis, reader.job.qid, OutputEvent((1,), "a", completion_tokens=1))
        first = await first_event(reader, 5)
        watcher = asyncio.ensure_future(asyncio.sleep(3600))
        with broken_renderer():
            out = "".join([chunk async for chunk in sse(ANSWER, first, reader, 5, done.append, watcher)])
        events = [e.removeprefix("data: ") for e in out.split("\n\n") if e]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert done == [] and phase(reader) is Phase.RELEASED

    run(redis_url, body)
