"""uvicorn's httptools protocol with the limits it lacks on what arrives before the app sees a request.

uvicorn bounds neither the time a client may take to send its request line and headers (a slowloris that
sends one byte every few seconds keeps a connection, and its file descriptor, forever: each byte even
re-arms nothing but cancels the keep-alive timer) nor their size. This protocol gives every request
`header_timeout_s` to complete its headers and `max_header_bytes` for them, then answers 408 or 431 and
closes. It also answers a malformed request with the OpenAI-style JSON error every other refusal uses,
and closes a connection whose request body was not read to its end (it cannot carry another request,
and a client trickling the rest must not keep it open).

Built for `http="httptools"`, the implementation `uvicorn[standard]` brings: `guarded_protocol()` makes
the class with its limits, for `uvicorn.run(http=...)`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import APIError


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._in_headers = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_begin()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_end()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Counted after parsing: only bytes that left the headers still incomplete are header bytes.
        if self._in_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._refuse(
                    APIError(
                        431,
                        f"Request headers longer than {self.max_header_bytes} bytes.",
                        code="headers_too_large",
                    )
                )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:
            self._headers_begin()

    def on_headers_complete(self) -> None:
        self._headers_end()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # With no pipelined request queued, `self.cycle` is the one that just answered.
        if not self.pipeline and self.cycle is not None and self.cycle.more_body:
            self.transport.close()  # its body was not read to the end
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._refuse(APIError(400, msg, code="invalid_http_request"))

    # -- internals -------------------------------------------------------------------------------------
    def _headers_begin(self) -> None:
        self._in_headers, self._header_bytes = True, 0
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _headers_end(self) -> None:
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined response is still going out: close after it
            return
        self._refuse(
            APIError(
                408,
                f"The request headers did not arrive within {self.header_timeout_s:g} s.",
                code="request_timeout",
            )
        )

    def _refuse(self, error: APIError) -> None:
        """Answer `error` and close, outside any request cycle (none has started for these bytes)."""
        self._headers_end()
        body = json.dumps(error.body()).encode()
        head = [STATUS_LINE[error.status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def guarded_protocol(header_timeout_s: float, max_header_bytes: int = 64 * 1024) -> type[HttpToolsProtocol]:
    """The protocol class with these limits, for `uvicorn.run(http=...)`."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes},
    )
