"""`/v1/completions`, `/v1/chat/completions` (streaming and not) and `/v1/models`.

A request is authenticated, validated, resolved to a base model (+ adapter), tokenized, routed, enqueued
on the chosen worker's stream, and its output stream is relayed. The gateway waits for the first output
event before answering, so errors found by the worker (a bad adapter file) still get a proper status.
A client that supplies `X-Request-Id` and retries after a dropped connection gets the same generation
relayed again from the start, instead of a second generation. A client that goes away cancels its
request on the worker.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway import protocol
from gateway.catalog import AUTO, Target
from gateway.context import GatewayContext, read_json
from gateway.errors import APIError, bad_request
from gateway.router import pick_worker
from loragate import keys
from loragate.hashing import block_hashes
from loragate.messages import OutputEvent, QueuedRequest

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{8,128}$")
_LIVENESS_S = 5.0


class OpenAIRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        tenant = await self.ctx.auth.tenant(request)
        now = int(time.time())
        data: list[dict[str, Any]] = [{"id": AUTO, "object": "model", "created": now, "owned_by": "loragate"}]
        bases = self.ctx.fleet.models()
        data += [{"id": b, "object": "model", "created": now, "owned_by": "loragate"} for b in sorted(bases)]
        for rec in sorted((await self.ctx.catalog.adapters()).values(), key=lambda r: r.key):
            if rec.allows(tenant):
                data.append(
                    {
                        "id": rec.key,
                        "object": "model",
                        "created": now,
                        "owned_by": "loragate",
                        "parent": rec.base,
                        "root": rec.base,
                    }
                )
        return JSONResponse({"object": "list", "data": data})

    # -- the request path ------------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        ctx = self.ctx
        tenant = await ctx.auth.tenant(request)
        body = await read_json(request, ctx.settings.max_body_bytes)
        parsed = protocol.parse_common(body, chat)
        target = await ctx.catalog.resolve(parsed.model, tenant)
        serving = ctx.fleet.serving(target.base)
        if not serving:
            raise APIError(
                503,
                f"No worker is serving '{target.base}' right now.",
                code="no_worker",
                headers={"Retry-After": "2"},
            )
        state = serving[0].state
        tok = ctx.tokenizers.get(state.model_dir)
        vocab = tok.tokenizer.get_vocab_size(with_added_tokens=True)
        if chat:
            prompt = tok.encode(tok.render_chat(protocol.chat_messages(body)))
        else:
            text, ids = protocol.completion_prompt(body, vocab)
            prompt = ids if ids is not None else tok.encode(text or "")
        if not prompt:
            raise bad_request("The prompt is empty after tokenization.", param="prompt")
        limit = min(w.state.max_model_len for w in serving)
        max_tokens = parsed.max_tokens or (limit - len(prompt) if chat else 16)
        if len(prompt) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or the completion length.",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        params = protocol.sampling_params(parsed, max_tokens)
        rid = self._request_id(request, chat)
        adapter_key = target.adapter.key if target.adapter else None
        # The same chained, adapter-keyed hashes the worker's prefix cache uses.
        hashes = block_hashes(prompt, state.block_size, adapter_key)
        if not await ctx.redis.exists(keys.output(rid)):
            cached = ctx.prefix_index.cached_blocks(hashes)
            worker = pick_worker(ctx.fleet, target, ctx.settings.max_queue_per_worker, cached)
            ctx.fleet.note_enqueued(worker.state.worker_id)  # before any await: concurrent picks see it
            ctx.prefix_index.record(worker.state.worker_id, hashes)
            msg = QueuedRequest(
                rid,
                target.base,
                tuple(prompt),
                params,
                adapter=target.adapter.key if target.adapter else None,
                tenant=tenant,
                traceparent=request.headers.get("traceparent"),
                deadline=time.time() + ctx.settings.request_timeout_s,
            )
            events = await ctx.mux.subscribe(rid)
            await ctx.redis.xadd(keys.queue(worker.state.worker_id), {"m": msg.to_json()})
        else:
            events = await ctx.mux.subscribe(rid)  # a retry of a request we already have: relay it again
        try:
            first = await self._next(events, target, ctx.settings.first_event_timeout_s)
        except APIError:
            await self._cancel(rid)
            raise
        if first.error is not None:
            ctx.mux.unsubscribe(rid)
            err = first.error
            raise APIError(int(err.get("status", 400)), str(err.get("message")), code=err.get("code"))
        headers = {"x-request-id": rid, "x-loragate-worker": first.worker_id}
        model_id = target.model_id if parsed.model != AUTO else target.base
        if parsed.stream:
            stream = self._sse(rid, model_id, chat, parsed.include_usage, first, events, target)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return await self._collect(rid, model_id, chat, first, events, target, headers)

    @staticmethod
    def _request_id(request: Request, chat: bool) -> str:
        given = request.headers.get("x-request-id")
        if given is None:
            return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if not _REQUEST_ID.match(given):
            raise bad_request(
                "X-Request-Id must be 8-128 characters of letters, digits, '.', '_', ':' or '-'."
            )
        return given

    async def _next(self, events: asyncio.Queue[OutputEvent], target: Target, timeout: float) -> OutputEvent:
        """The next event; fails instead of hanging when no worker can produce it."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, "Timed out waiting for the model's output.", code="timeout")
            try:
                return await asyncio.wait_for(events.get(), min(_LIVENESS_S, remaining))
            except TimeoutError:
                if not self.ctx.fleet.serving(target.base):
                    raise APIError(
                        503,
                        f"No worker is serving '{target.base}' any more.",
                        code="no_worker",
                        headers={"Retry-After": "2"},
                    ) from None

    async def _cancel(self, rid: str) -> None:
        self.ctx.mux.unsubscribe(rid)
        await self.ctx.redis.publish(keys.CANCEL, rid)

    async def _collect(
        self,
        rid: str,
        model: str,
        chat: bool,
        first: OutputEvent,
        events: asyncio.Queue[OutputEvent],
        target: Target,
        headers: dict[str, str],
    ) -> Response:
        texts, event = [first.text], first
        try:
            while not event.is_last:
                event = await self._next(events, target, self.ctx.settings.request_timeout_s)
                if event.error is not None:
                    err = event.error
                    raise APIError(int(err.get("status", 500)), str(err.get("message")), code=err.get("code"))
                texts.append(event.text)
        except (APIError, asyncio.CancelledError):
            await self._cancel(rid)
            raise
        self.ctx.mux.unsubscribe(rid)
        use = protocol.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        build = protocol.chat_body if chat else protocol.completion_body
        return JSONResponse(build(rid, model, "".join(texts), event.finish_reason, use), headers=headers)

    async def _sse(
        self,
        rid: str,
        model: str,
        chat: bool,
        include_usage: bool,
        first: OutputEvent,
        events: asyncio.Queue[OutputEvent],
        target: Target,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        event, done = first, False

        def data(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        try:
            if chat:
                yield data(
                    protocol.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None)
                )
            while True:
                if event.error is not None:
                    yield data({"error": {k: v for k, v in event.error.items() if k != "status"}})
                    break
                if event.text or event.is_last:
                    if chat:
                        delta = {"content": event.text} if event.text else {}
                        yield data(protocol.chat_chunk(rid, model, created, delta, event.finish_reason))
                    else:
                        yield data(
                            protocol.completion_chunk(rid, model, created, event.text, event.finish_reason)
                        )
                if event.is_last:
                    if include_usage:
                        use = protocol.usage(
                            event.prompt_tokens, event.completion_tokens, event.cached_tokens
                        )
                        yield data(protocol.usage_chunk(rid, model, created, chat, use))
                    break
                try:
                    event = await self._next(events, target, self.ctx.settings.request_timeout_s)
                except APIError as e:
                    yield data(e.body())
                    break
            done = event.is_last
            yield "data: [DONE]\n\n"
        finally:
            if done:
                self.ctx.mux.unsubscribe(rid)
            else:  # the client went away (or the stream failed): free the worker's sequence
                await self._cancel(rid)
