"""ReadLimits: a body announced too long is refused (413) before the app runs; one that streams past the
limit (413) or arrives too slowly (408) is cut off while the app reads it; after the body, reads are not
bounded; non-HTTP scopes pass through untouched."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import APIError
from gateway.read_limits import ReadLimits, body_timeout

Step = Callable[[], Awaitable[Message]]


class ReadingApp:
    """An app that reads `reads` messages and records them."""

    def __init__(self, reads: int):
        self.reads, self.got, self.called = reads, list[Message](), False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.called = True
        for _ in range(self.reads):
            self.got.append(await receive())


def _scripted(steps: list[Step]) -> Receive:
    async def receive() -> Message:
        return await steps.pop(0)()

    return receive


def _message(body: bytes, more: bool) -> Step:
    async def step() -> Message:
        return {"type": "http.request", "body": body, "more_body": more}

    return step


def _after(seconds: float, message: Message) -> Step:
    async def step() -> Message:
        await asyncio.sleep(seconds)
        return message

    return step


def _run(
    app: ReadingApp, steps: list[Step], headers: list[tuple[bytes, bytes]] | None = None, timeout: float = 5
) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": headers or []}
    asyncio.run(ReadLimits(app, max_body_bytes=10, body_timeout_s=timeout)(scope, _scripted(steps), send))
    return sent


def test_body_within_limits_reaches_the_app() -> None:
    app = ReadingApp(2)
    sent = _run(app, [_message(b"12345", True), _message(b"67890", False)], [(b"content-length", b"10")])
    assert [m["body"] for m in app.got] == [b"12345", b"67890"] and sent == []


def test_announced_too_long_is_refused_before_the_app() -> None:
    app = ReadingApp(1)
    sent = _run(app, [], [(b"content-length", b"11")])
    assert not app.called
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert (b"connection", b"close") in sent[0]["headers"]
    assert b"(11 bytes)" in sent[1]["body"]


def test_streamed_past_the_limit_is_413() -> None:
    app = ReadingApp(2)
    with pytest.raises(APIError) as e:
        _run(app, [_message(b"123456", True), _message(b"78901", True)])
    assert e.value.status == 413 and len(app.got) == 1


def test_a_slow_body_is_408() -> None:
    app = ReadingApp(2)
    with pytest.raises(APIError) as e:
        _run(app, [_message(b"1", True), _after(5, {"type": "http.request", "body": b"2"})], timeout=0.2)
    assert (e.value.status, e.value.code) == (408, "request_timeout") and len(app.got) == 1


def test_after_the_body_waiting_for_a_disconnect_is_unbounded() -> None:
    app = ReadingApp(2)
    _run(app, [_message(b"1", False), _after(0.4, {"type": "http.disconnect"})], timeout=0.2)
    assert app.got[1] == {"type": "http.disconnect"}


def test_a_disconnect_ends_the_bound() -> None:
    app = ReadingApp(2)
    _run(app, [_after(0, {"type": "http.disconnect"}), _after(0.4, {"type": "http.disconnect"})], timeout=0.2)
    assert [m["type"] for m in app.got] == ["http.disconnect", "http.disconnect"]


@pytest.mark.parametrize(
    "kind", [pytest.param("lifespan", id="lifespan"), pytest.param("websocket", id="ws")]
)
def test_other_scopes_pass_through(kind: str) -> None:
    app = ReadingApp(1)
    scope = {"type": kind}

    async def send(message: Message) -> None:
        raise AssertionError("nothing sent")

    big = _message(b"x" * 100, False)  # over the limit: not checked outside HTTP
    asyncio.run(ReadLimits(app, 10, 0.1)(scope, _scripted([big]), send))
    assert app.got[0]["body"] == b"x" * 100


def test_body_timeout_error() -> None:
    error = body_timeout(2.5)
    assert (error.status, error.headers) == (408, {"Connection": "close"}) and "2.5 s" in error.message
