"""`ReadLimits`: an ASGI middleware that bounds every request body, on every route, in size and in time.

A body announced longer than `max_body_bytes` is refused with 413 before a byte of it is read; one that
streams in without a `Content-Length` is cut off (413) as soon as it passes the limit. A client that
trickles its body cannot hold a connection (and a worker slot of the event loop) forever: the whole body
must arrive within `body_timeout_s` of the request's start, else 408. Both refusals close the connection,
since the rest of the body is never read. Routes add smaller limits of their own (gateway/limits.py).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError
from gateway.limits import request_too_large


def body_timeout(seconds: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {seconds:g} s.",
        code="request_timeout",
        headers={"Connection": "close"},
    )


class ReadLimits:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await request_too_large(self.max_body_bytes, int(length)).response()(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        received, complete = 0, False

        async def bounded_receive() -> Message:
            nonlocal received, complete
            if complete:  # the body is in: what follows is waiting for a disconnect, which has no bound
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise body_timeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise request_too_large(self.max_body_bytes)
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, bounded_receive, send)
