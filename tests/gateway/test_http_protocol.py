"""The guarded httptools protocol, driven byte by byte through a fake transport (no socket): headers
that take too long (408) or grow too large (431), and a malformed request (400), are answered with the
OpenAI error object and the connection closed; a request whose headers complete in time reaches the app.
(tests/gateway/test_input_limits.py checks the same limits against a real uvicorn on a real socket.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.http_protocol import GuardedHttpToolsProtocol, guarded_protocol


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = bytearray(), False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _ok_app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _connect(header_timeout_s: float = 5.0, max_header_bytes: int = 1024) -> tuple[Any, FakeTransport]:
    config = Config(app=_ok_app, http="httptools", lifespan="off", log_level="warning")
    config.load()
    cls = guarded_protocol(header_timeout_s, max_header_bytes)
    protocol = cls(config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


def _answer(transport: FakeTransport) -> tuple[int, dict[str, Any]]:
    head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"connection: close" in head.lower() and b"content-type: application/json" in head
    return status, json.loads(body)["error"]


def test_guarded_protocol_carries_its_limits() -> None:
    cls = guarded_protocol(2.5, 4096)
    assert issubclass(cls, GuardedHttpToolsProtocol)
    assert (cls.header_timeout_s, cls.max_header_bytes) == (2.5, 4096)
    assert guarded_protocol(1.0).max_header_bytes == 64 * 1024


def test_headers_that_do_not_arrive_in_time_are_408() -> None:
    async def main() -> FakeTransport:
        protocol, transport = _connect(header_timeout_s=0.1)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
        await asyncio.sleep(0.3)
        return transport

    transport = asyncio.run(main())
    status, error = _answer(transport)
    assert (status, error["code"]) == (408, "request_timeout") and transport.closed


def test_an_idle_connection_is_closed_after_the_header_timeout_too() -> None:
    async def main() -> FakeTransport:
        _, transport = _connect(header_timeout_s=0.1)  # connected, sends nothing
        await asyncio.sleep(0.3)
        return transport

    assert _answer(asyncio.run(main()))[0] == 408


def test_headers_over_the_limit_are_431() -> None:
    async def main() -> FakeTransport:
        protocol, transport = _connect(max_header_bytes=100)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")
        protocol.data_received(b"X-Pad: " + b"a" * 200 + b"\r\n")
        return transport

    status, error = _answer(asyncio.run(main()))
    assert (status, error["code"]) == (431, "headers_too_large") and "100 bytes" in error["message"]


def test_a_malformed_request_is_a_json_400() -> None:
    async def main() -> FakeTransport:
        protocol, transport = _connect()
        protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
        return transport

    status, error = _answer(asyncio.run(main()))
    assert (status, error["code"], error["type"]) == (400, "invalid_http_request", "invalid_request_error")


@pytest.mark.parametrize("pieces", [pytest.param(1, id="at once"), pytest.param(3, id="in pieces")])
def test_a_request_in_time_reaches_the_app_and_no_timer_is_left(pieces: int) -> None:
    async def main() -> tuple[FakeTransport, Any]:
        protocol, transport = _connect(header_timeout_s=0.2)
        raw = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        step = len(raw) // pieces + 1
        for i in range(0, len(raw), step):
            protocol.data_received(raw[i : i + step])
        await asyncio.sleep(0.4)  # past the header timeout: nothing may fire now
        return transport, protocol

    transport, protocol = asyncio.run(main())
    assert bytes(transport.written).startswith(b"HTTP/1.1 200 OK") and bytes(transport.written).endswith(
        b"ok"
    )
    assert b"408" not in bytes(transport.written)
    assert not transport.closed  # keep-alive: the connection stays for the next request
    protocol.connection_lost(None)
