"""The choices of one request run side by side on a real Redis (the worker's part played by writing its
output streams): a prompt's siblings are queued only once its first choice has output, different prompts
at once; the answer has every choice in index order (or interleaved, streamed) with one usage and one
`[DONE]`; a failure fails the answer and cancels the others; a client that leaves cancels them all; a
retry re-attaches to every choice; and every choice's charge and reservation end exactly once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any
from unittest import mock

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from gateway.choice_render import ChoiceRenderer
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline import fanout
from gateway.pipeline.choices import ChoicePlan, choice_seed, plan_choices, prompt_items
from gateway.pipeline.enqueue import enqueue
from gateway.pipeline.fanout import ChoiceSet
from gateway.pipeline.respond import respond_choices
from gateway.pipeline.stream import Answer
from gateway.sse import EventStreamResponse
from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest
from tests.gateway.pipeline.live_context import BASE, WORKERS, call, live_context, put, resolved, run
from worker.modelzoo.make import ZooPaths

RID = "req-fanout-01"
PROMPT = "The quick brown fox jumps over the lazy dog, again and again"


class Client:
    """A real starlette request whose client leaves when told to."""

    def __init__(self, request_id: str = RID):
        self.left = asyncio.Event()
        self.sent = False
        scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "query_string": b"",
            "headers": [(b"x-request-id", request_id.encode())],
        }
        self.request = Request(scope, self.receive)

    async def receive(self) -> Message:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}


async def queued(ctx: GatewayContext) -> dict[str, QueuedRequest]:
    """What waits on the workers' queues, by scoped request id."""
    out = {}
    for w in WORKERS:
        for _, fields in await ctx.redis.xrange(contracts.queue(BASE, w)):
            msg = QueuedRequest.from_json(fields[contracts.QUEUE_FIELD_BYTES])
            out[msg.request_id] = msg
    return out


async def until_queued(ctx: GatewayContext, count: int) -> dict[str, QueuedRequest]:
    deadline = time.monotonic() + 5
    while len(found := await queued(ctx)) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} queued"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # and no more
    found = await queued(ctx)
    assert len(found) == count
    return found


def outstanding(ctx: GatewayContext) -> int:
    return sum(w.queue_len for w in ctx.fleet.workers.values())


def answer(stream: bool = False, chat: bool = False) -> Answer:
    return Answer(RID, BASE, chat, include_usage=True)


def start(
    ctx: GatewayContext, client: Client, stream: bool = False, **body: Any
) -> tuple[list[ChoicePlan], asyncio.Future[Response]]:
    c = call(prompt=body.pop("prompt", PROMPT), max_tokens=4, **body)
    n = int(body.get("n") or 1)
    plans = plan_choices(ctx, client.request, c, resolved(ctx), prompt_items(c), n)
    choices = ChoiceSet(ctx, client.request, c, resolved(ctx), plans, time.monotonic())
    return plans, asyncio.ensure_future(
        respond_choices(ctx, client.request, answer(stream), stream, choices, {"x-request-id": RID})
    )


def last(text: str, completion_tokens: int, cached: int = 0, prompt_tokens: int = 12) -> OutputEvent:
    return OutputEvent(
        text=text,
        finish_reason="stop",
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
    )


def token(text: str, completion_tokens: int = 1) -> OutputEvent:
    return OutputEvent((7,), text, completion_tokens=completion_tokens, worker_id="w-seen")


def live(zoo: ZooPaths, redis_url: str, body: Callable[[GatewayContext], Awaitable[None]]) -> None:
    """`body` on a live gateway context whose fleet view is not refreshed from Redis after it starts: no
    worker here acknowledges (and deletes) the queued entries as a real one does when it finishes, so a
    refresh would count them again; frozen, the view's queue lengths move only by this gateway's own
    reservations, and `outstanding` is exactly what they still hold. The reaper refreshes the view too
    (each sweep, every second: a slow run reaches one), so it is stopped first."""

    async def frozen(ctx: GatewayContext) -> None:
        await ctx.reaper.stop()
        # Stopped between refreshes (right after one ends: its loop is then asleep), never inside one,
        # which would leave a Redis connection checked out and unclosed.
        ctx.fleet.refreshed.clear()
        await ctx.fleet.refreshed.wait()
        await ctx.fleet.stop()
        await body(ctx)

    run(redis_url, frozen, model_dir=str(zoo.base("tiny")))


def test_siblings_wait_for_the_first_choice_and_the_answer_is_in_order(redis_url: str, zoo: ZooPaths) -> None:
    async def body(ctx: GatewayContext) -> None:
        with mock.patch.object(ctx.admission, "settle", wraps=ctx.admission.settle) as settle:
            plans, response = start(ctx, Client(), n=3, seed=5)
            lead = await until_queued(ctx, 1)  # only choice 0: its siblings wait for its prefill
            assert list(lead) == [plans[0].job.qid]
            await put(ctx.redis, plans[0].job.qid, token("a"))
            siblings = await until_queued(ctx, 3)
            assert [siblings[p.job.qid].params.seed for p in plans] == [
                5,
                choice_seed(5, 1),
                choice_seed(5, 2),
            ]
            for i in (2, 0, 1):  # the answer's order is the index, not the order of ending
                await put(ctx.redis, plans[i].job.qid, last(f"{i}", 1 + i, cached=8 * (i > 0)))
            got = await response
        assert got.headers["x-loragate-worker"] == "w-seen"
        out = json.loads(bytes(got.body))
        assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "a0"), (1, "1"), (2, "2")]
        assert out["id"] == RID and {c["finish_reason"] for c in out["choices"]} == {"stop"}
        assert out["usage"]["prompt_tokens"] == 12  # the prompt once
        assert out["usage"]["completion_tokens"] == 1 + 2 + 3
        assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
        assert sorted(c.args[3:] for c in settle.call_args_list) == [(12, 1), (12, 2), (12, 3)]  # once each
        assert outstanding(ctx) == 0

    live(zoo, redis_url, body)


def test_different_prompts_start_at_once(redis_url: str, zoo: ZooPaths) -> None:
    async def body(ctx: GatewayContext) -> None:
        plans, response = start(ctx, Client(), prompt=["first prompt", [11, 12, 13]], n=2)
        leads = await until_queued(ctx, 2)
        assert set(leads) == {plans[0].job.qid, plans[2].job.qid}
        assert leads[plans[2].job.qid].prompt_token_ids == (11, 12, 13)
        await put(ctx.redis, plans[2].job.qid, token("x"))
        assert plans[3].job.qid in await until_queued(ctx, 3)  # its own sibling only
        await put(ctx.redis, plans[0].job.qid, token("y"))
        await until_queued(ctx, 4)
        for p in plans:
            await put(ctx.redis, p.job.qid, last(".", 2, prompt_tokens=3 + p.prompt_index))
        out = json.loads(bytes((await response).body))
        assert [c["text"] for c in out["choices"]] == ["y.", ".", "x.", "."]
        assert out["usage"]["prompt_tokens"] == 3 + 4 and out["usage"]["completion_tokens"] == 8
        assert outstanding(ctx) == 0

    live(zoo, redis_url, body)


def test_a_stream_interleaves_choices_then_one_usage_and_one_done(redis_url: str, zoo: ZooPaths) -> None:
    async def body(ctx: GatewayContext) -> None:
        plans, response = start(ctx, Client(), stream=True, n=2)
        await until_queued(ctx, 1)
        await put(ctx.redis, plans[0].job.qid, token("a"))
        await until_queued(ctx, 2)
        await put(ctx.redis, plans[1].job.qid, token("x"))
        await put(ctx.redis, plans[0].job.qid, last("b", 2))
        await put(ctx.redis, plans[1].job.qid, last("y", 2))
        got = await response
        assert isinstance(got, EventStreamResponse)
        raw = "".join([part async for part in got.chunks])
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]" and raw.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        *texts, usage = chunks
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
        assert all(len(c["choices"]) == 1 for c in texts)
        by_index: dict[int, str] = {}
        for c in texts:
            by_index[c["choices"][0]["index"]] = (
                by_index.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
            )
        assert by_index == {0: "ab", 1: "xy"}
        assert [c["choices"][0]["index"] for c in texts if c["choices"][0]["finish_reason"]] in (
            [0, 1],
            [1, 0],
        )
        assert outstanding(ctx) == 0

    live(zoo, redis_url, body)


def test_a_later_failure_fails_the_answer_and_cancels_the_others(redis_url: str, zoo: ZooPaths) -> None:
    async def body(ctx: GatewayContext) -> None:
        plans, response = start(ctx, Client(), n=3)
        await until_queued(ctx, 1)
        await put(ctx.redis, plans[0].job.qid, token("a"))
        await until_queued(ctx, 3)
        await put(ctx.redis, plans[2].job.qid, last("done", 1))
        await put(ctx.redis, plans[1].job.qid, OutputEvent(error={"status": 503, "message": "lost"}))
        with pytest.raises(APIError) as e:
            await response
        assert e.value.status == 503 and e.value.headers["Retry-After"] == "2"
        left = await queued(ctx)  # choice 0, still unread by its worker, was dropped from its queue
        assert plans[0].job.qid not in left and plans[2].job.qid in left  # choice 2 had ended
        assert outstanding(ctx) == 0

    live(zoo, redis_url, body)


def test_a_later_failure_in_a_stream_is_an_error_chunk_and_cancels_the_others(
    redis_url: str, zoo: ZooPaths
) -> None:
    async def body(ctx: GatewayContext) -> None:
        plans, response = start(ctx, Client(), stream=True, n=2)
        await until_queued(ctx, 1)
        await put(ctx.redis, plans[0].job.qid, token("a"))
        await until_queued(ctx, 2)
        await put(
            ctx.redis, plans[1].job.qid, OutputEvent(error={"status": 500, "message": "boom", "code": "x"})
        )
        got = await response
        assert isinstance(got, EventStreamResponse)
        events = [e.removeprefix("data: ") for e in "".join([p async for p in got.chunks]).split("\n\n") if e]
        assert events[-1] == "[DONE]" and json.loads(events[-2]) == {
            "error": {"message": "boom", "code": "x"}
        }
        assert not any("usage" in json.loads(e) for e in events[:-1])
        assert plans[0].job.qid not in await queued(ctx) and outstanding(ctx) == 0  # choice 0 cancelled

    live(zoo, redis_url, body)


def test_an_unexpected_error_in_a_stream_is_an_error_chunk_and_cancels_every_choice(
    redis_url: str, zoo: ZooPaths
) -> None:
    async def body(ctx: GatewayContext) -> None:
        plans, response = start(ctx, Client(), stream=True, n=2)
        await until_queued(ctx, 1)
        await put(ctx.redis, plans[0].job.qid, token("a"))
        await until_queued(ctx, 2)
        got = await response
        assert isinstance(got, EventStreamResponse)
        with mock.patch.object(ChoiceRenderer, "feed", side_effect=RuntimeError("bug")):
            text = "".join([p async for p in got.chunks])
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert await queued(ctx) == {} and outstanding(ctx) == 0  # both choices cancelled

    live(zoo, redis_url, body)


def test_a_first_choice_failing_first_keeps_its_status_and_starts_no_sibling(
    redis_url: str, zoo: ZooPaths
) -> None:
    async def body(ctx: GatewayContext) -> None:
        plans, response = start(ctx, Client(), n=4)
        await until_queued(ctx, 1)
        await put(ctx.redis, plans[0].job.qid, OutputEvent(error={"message": "bad adapter"}))
        with pytest.raises(APIError) as e:
            await response
        assert e.value.status == 400 and e.value.message == "bad adapter"
        await until_queued(ctx, 1)
        assert outstanding(ctx) == 0

    live(zoo, redis_url, body)


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_client_that_leaves_cancels_every_choice(redis_url: str, zoo: ZooPaths, stream: bool) -> None:
    async def body(ctx: GatewayContext) -> None:
        client = Client()
        plans, response = start(ctx, client, stream=stream, n=3)
        await until_queued(ctx, 1)
        await put(ctx.redis, plans[0].job.qid, token("a"))
        await until_queued(ctx, 3)
        if stream:  # the stream has begun when the client leaves
            got = await response
            assert isinstance(got, EventStreamResponse)
            client.left.set()
            assert "[DONE]" not in "".join([part async for part in got.chunks])
        else:
            client.left.set()
            with pytest.raises(APIError) as e:
                await response
            assert e.value.status == 499
        assert await queued(ctx) == {} and outstanding(ctx) == 0  # every choice dropped from its queue

    live(zoo, redis_url, body)


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_client_that_leaves_while_choices_are_being_queued_finds_them_all_ended(
    redis_url: str, zoo: ZooPaths, stream: bool
) -> None:
    """The client leaves while the siblings' enqueue round trips are still in flight (queued in Redis,
    not yet returned): once the response ends, their reservations are released and their jobs dropped
    already, not by a clean-up that runs later."""

    async def slow_enqueue(*args: Any) -> Any:
        reader = await enqueue(*args)
        await asyncio.sleep(0.3)  # the reply is slow: the request is queued, this handler not told yet
        return reader

    async def body(ctx: GatewayContext) -> None:
        client = Client()
        plans, response = start(ctx, client, stream=stream, n=3)
        await until_queued(ctx, 1)
        with mock.patch.object(fanout, "enqueue", slow_enqueue):
            await put(ctx.redis, plans[0].job.qid, token("a"))
            await until_queued(ctx, 3)  # the siblings are queued; their starts wait on the reply
            if stream:
                got = await response
                assert isinstance(got, EventStreamResponse)
                client.left.set()
                assert "[DONE]" not in "".join([part async for part in got.chunks])
            else:
                client.left.set()
                with pytest.raises(APIError) as e:
                    await response
                assert e.value.status == 499
            assert outstanding(ctx) == 0  # right away: nothing still held
            assert await queued(ctx) == {}

    live(zoo, redis_url, body)


def test_a_retry_reattaches_to_every_choice(redis_url: str, zoo: ZooPaths) -> None:
    async def body(ctx: GatewayContext) -> None:
        plans, response = start(ctx, Client(), n=2)
        await until_queued(ctx, 1)
        await put(ctx.redis, plans[0].job.qid, token("a"))
        await until_queued(ctx, 2)
        for p in plans:
            await put(ctx.redis, p.job.qid, last(f"{p.index}", 2))
        first = json.loads(bytes((await response).body))
        with mock.patch.object(ctx.admission, "settle", wraps=ctx.admission.settle) as settle:
            _, again = start(ctx, Client(), n=2)
            second = json.loads(bytes((await again).body))
        assert second["choices"] == first["choices"] and second["usage"] == first["usage"]
        assert len(await queued(ctx)) == 2 and settle.call_count == 0  # nothing queued or charged again
        _, other = start(ctx, Client(), n=3)  # the same id asking for other choices
        with pytest.raises(APIError) as e:
            await other
        assert e.value.status == 409 and outstanding(ctx) == 0

    live(zoo, redis_url, body)


def test_a_choice_stopped_while_it_waits_for_admission_is_cancelled_once_queued(
    redis_url: str, zoo: ZooPaths
) -> None:
    """The second prompt's choice waits for its fair turn when the first fails: its start is not cut
    short (admission and enqueueing account for what they did), and what it queued is cancelled."""

    async def main() -> None:
        async with live_context(redis_url, ("w-a",), str(zoo.base("tiny"))) as ctx:
            ctx.admission.per_worker = 1  # room for one request: the second waits
            plans, response = start(ctx, Client(), prompt=["first prompt", "second prompt"])
            # Both leads start at once; either may reach admission first (each asks Redis whether it is
            # a retry before), so the one admitted is the one queued.
            (admitted,) = await until_queued(ctx, 1)
            waiting = next(p.job.qid for p in plans if p.job.qid != admitted)
            assert ctx.admission.waiting(BASE) == 1
            await put(ctx.redis, admitted, OutputEvent(error={"message": "bad adapter"}))
            with pytest.raises(APIError) as e:
                await response
            assert e.value.status == 400
            second = contracts.output(BASE, waiting)
            deadline = time.monotonic() + 5
            while not await ctx.redis.exists(second):  # queued once its turn came, then cancelled
                assert time.monotonic() < deadline, await queued(ctx)
                await asyncio.sleep(0.01)
            events = [
                OutputEvent.from_json(f[contracts.OUTPUT_FIELD_BYTES])
                for _, f in await ctx.redis.xrange(second)
            ]
            assert [e.finish_reason for e in events] == ["abort"]  # dropped from its queue unread
            assert list(await queued(ctx)) == [admitted]  # (the first's entry is its worker's to delete)
            assert ctx.admission.waiting(BASE) == 0
            assert ctx.router.state.queued_tokens == {}

    asyncio.run(asyncio.wait_for(main(), 15))
