"""A lean `text/event-stream` response.

Starlette's `StreamingResponse`, under an ASGI server that speaks spec < 2.4 (uvicorn 0.54 says 2.3),
runs every response in an anyio task group with a second task listening for the disconnect. That costs
more than the rest of the response on the TTFT path, and the gateway watches for disconnects itself
(from the moment a request is enqueued, not only once it streams: `gateway.pipeline.respond.watch`).
This response only writes: the head, one body message per chunk, and the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], headers: Mapping[str, str] | None = None):
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
