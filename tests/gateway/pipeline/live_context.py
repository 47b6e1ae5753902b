"""The gateway's own request context (`gateway.app.gateway_context`, as the app builds it) over the
session's real Redis, with live workers announced by heartbeat, and the stages' inputs built without
I/O: a real starlette `Request` from an ASGI scope, a parsed call, a resolved target, a prompt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan
from starlette.requests import Request
from starlette.types import Message

from gateway import protocol
from gateway.app import gateway_context
from gateway.context import GatewayContext
from gateway.model_catalog import Target
from gateway.pipeline.job import Job, make_job
from gateway.pipeline.parse import Call
from gateway.pipeline.prompt import Prompt
from gateway.pipeline.resolve import Resolved
from gateway.settings import GatewaySettings
from loragate import contracts
from loragate.messages import OutputEvent, WorkerState
from loragate.types import SamplingParams

BASE = "tiny"
TENANT = "alice"
WORKERS = ("w-a", "w-b")


def worker_state(worker_id: str, model_dir: str = "/m") -> WorkerState:
    """`model_dir`: where the gateway reads the tokenizer (a real model's folder, for stages that need it)."""
    return WorkerState(
        worker_id, BASE, model_dir, 2048, kv_blocks_free=100, kv_blocks_total=100, updated_at=time.time()
    )


@asynccontextmanager
async def live_context(
    redis_url: str, workers: tuple[str, ...] = WORKERS, model_dir: str = "/m"
) -> AsyncIterator[GatewayContext]:
    r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        for w in workers:
            await r.set(contracts.worker_state(BASE, w), worker_state(w, model_dir).to_json(), ex=60)
            await r.xgroup_create(contracts.queue(BASE, w), contracts.WORKER_GROUP, id="0", mkstream=True)
    finally:
        await r.aclose()
    settings = GatewaySettings(redis_url, api_keys={"key-alice": TENANT}, redis_timeout_s=2.0)
    async with gateway_context(settings) as ctx:
        yield ctx


def run(redis_url: str, body: Callable[[GatewayContext], Awaitable[None]], model_dir: str = "/m") -> None:
    async def main() -> None:
        async with live_context(redis_url, model_dir=model_dir) as ctx:
            await asyncio.wait_for(body(ctx), 15)

    asyncio.run(main())


def http_request(
    headers: dict[str, str] | None = None, disconnected: bool = False, body: bytes = b""
) -> Request:
    """A POST of `body` whose client is still there (or gone, `disconnected`)."""
    sent = False
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnected:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    return Request(scope, receive)


def call(prompt: str = "hi", chat: bool = False, **body: Any) -> Call:
    full = {"model": BASE, "prompt": prompt, **body}
    parsed = protocol.parse_common(full, chat)
    return Call(chat, TENANT, full, parsed, [], NonRecordingSpan(INVALID_SPAN_CONTEXT))


def resolved(ctx: GatewayContext) -> Resolved:
    return Resolved.of(Target(BASE, None), None, tuple(ctx.fleet.serving(BASE)))


def prompt(tokens: int = 40, max_tokens: int = 8) -> Prompt:
    return Prompt(
        "x" * tokens, tuple(range(1, tokens + 1)), max_tokens, SamplingParams(max_tokens=max_tokens)
    )


def job(ctx: GatewayContext, request_id: str = "req-00000001", tokens: int = 40) -> Job:
    request = http_request({"x-request-id": request_id})
    return make_job(ctx, request, call(), resolved(ctx), prompt(tokens))


async def put(r: aioredis.Redis, qid: str, event: OutputEvent) -> None:
    await r.xadd(contracts.output(BASE, qid), {contracts.OUTPUT_FIELD: event.to_json()})
