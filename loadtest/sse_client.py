"""A minimal HTTP/1.1 streaming client over one keep-alive socket, for latency benchmarks.

General clients (httpx, the `openai` SDK) spend a few hundred microseconds of their own per request
building it and parsing the response, which would be counted as the gateway's latency when the gateway
is compared with an in-process engine. This one sends pre-encoded bytes and parses only what it must:
the status line and headers, chunked transfer encoding, and server-sent events.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any


class SSEClientError(RuntimeError):
    pass


@dataclass
class StreamResult:
    status: int
    ttft_s: float | None = None  # send → first event with text or a finish reason
    text: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # saw `data: [DONE]`


class SSEClient:
    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None, timeout_s: float = 60.0):
        self.host, self.port = host, port
        self.headers = {"Host": f"{host}:{port}", "Content-Type": "application/json", **(headers or {})}
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    @classmethod
    def for_url(cls, base: str, headers: dict[str, str] | None = None) -> SSEClient:
        """A client for `http://host:port`."""
        host, port = base.removeprefix("http://").rsplit(":", 1)
        return cls(host, int(port), headers)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> SSEClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
        """The request's bytes (build them before timing starts)."""
        payload = json.dumps(body).encode()
        lines = [f"POST {path} HTTP/1.1"] + [
            f"{k}: {v}" for k, v in {**self.headers, **(headers or {})}.items()
        ]
        lines.append(f"Content-Length: {len(payload)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload

    def stream(self, request: bytes) -> StreamResult:
        """Send `request` and read its whole streamed response."""
        start = time.perf_counter()
        self.sock.sendall(request)
        head = self._read_until(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        result = StreamResult(status)
        if b"transfer-encoding: chunked" not in head.lower():
            length = next(
                (
                    int(h.split(b":", 1)[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length:")
                ),
                0,
            )
            result.events.append(json.loads(self._read_exactly(length)))
            return result
        pending = b""
        while True:
            size = int(self._read_until(b"\r\n").split(b";")[0] or b"0", 16)
            if size == 0:
                self._read_until(b"\r\n")
                return result
            pending += self._read_exactly(size)
            self._read_exactly(2)
            *events, pending = pending.split(b"\n\n")
            for raw in events:
                if not raw.startswith(b"data: "):
                    continue
                if raw == b"data: [DONE]":
                    result.done = True
                    continue
                event = json.loads(raw[6:])
                result.events.append(event)
                for choice in event.get("choices", ()):
                    piece = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
                    if result.ttft_s is None and (piece or choice.get("finish_reason")):
                        result.ttft_s = time.perf_counter() - start
                    result.text += piece or ""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise SSEClientError("the server closed the connection")
        self._buf += data

    def _read_until(self, sep: bytes) -> bytes:
        while (i := self._buf.find(sep)) < 0:
            self._fill()
        out, self._buf = self._buf[:i], self._buf[i + len(sep) :]
        return out

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._fill()
        out, self._buf = self._buf[:n], self._buf[n:]
        return out
