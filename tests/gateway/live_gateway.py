"""A real gateway app served by a real uvicorn (with the guarded protocol, as `loragate gateway` runs it)
in a thread of the test process, on 127.0.0.1, over the session's real Redis; and raw-socket helpers for
the requests no HTTP client would send."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.http_protocol import guarded_protocol
from gateway.settings import GatewaySettings
from tests.e2e.stack import ADMIN_TOKEN, API_KEYS, free_port


@contextmanager
def live_gateway(redis_url: str, **overrides: Any) -> Iterator[str]:
    """Serves until the block ends; yields the base URL."""
    settings = GatewaySettings(redis_url, admin_token=ADMIN_TOKEN, api_keys=dict(API_KEYS), **overrides)
    port = free_port()
    config = uvicorn.Config(
        create_app(settings),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        http=guarded_protocol(settings.header_timeout_s),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_response(sock: socket.socket, data: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One response read to its Content-Length, after `data` already read of it: (status, lower-cased
    headers, body). A response may arrive in several segments (its head and body apart)."""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closed the connection (reads end) within the socket's timeout."""
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def error_of(body: bytes) -> dict[str, Any]:
    """The OpenAI-style error object in `body`, asserting its shape."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error
