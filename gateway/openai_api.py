"""`/v1/completions`, `/v1/chat/completions` (streaming and not) and `/v1/models`.

A request is authenticated, validated, resolved to a base model (+ adapter), tokenized, routed, enqueued
on the chosen worker's stream, and its output stream is relayed. The gateway waits for the first output
event before answering, so errors found by the worker (a bad adapter file) still get a proper status.
Request ids are scoped to the tenant of the key that sent them (`request_store`): another tenant's id
names another request. A client that supplies `X-Request-Id` and retries after a dropped connection gets
the same generation relayed again from the start, instead of a second generation, whether the request
still waits in a queue, runs, or has finished. A client that goes away cancels its request: dropped from
its queue if no worker has read it yet, else aborted on the worker. A handler that reads such an abort
while its own client is still there (a retry; another handler of the same id whose client left) continues
the request after the tokens already streamed, so a retry never gets a cut-short answer as a success.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from opentelemetry.trace import get_current_span
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from gateway import protocol
from gateway.context import GatewayContext, read_json
from gateway.errors import APIError, bad_request, queue_unavailable
from gateway.model_catalog import AUTO, Target
from gateway.reaper import least_loaded
from gateway.relay import ClientGone, EventChannel
from gateway.request_store import RequestStore, fingerprint
from gateway.routing import AliasChoice, decision_attributes, route_request
from gateway.sse import EventStreamResponse
from loragate import contracts
from loragate.hashing import block_hashes
from loragate.messages import OutputEvent, QueuedRequest
from loragate.tracing import inject, span

log = logging.getLogger("loragate.gateway")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{8,128}$")
_LIVENESS_S = 5.0
_MAX_CONTINUES = 8  # a request cut short by cancels more often than this fails instead


class OpenAIRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx  # one instance per request
        self._routed_to: str | None = None  # the worker this request was queued on by this handler
        self._events: EventChannel | None = None  # this handler's channel of the request's output
        self._continued = 0  # how often this handler queued the request again after an abort

    async def completions(self, request: Request) -> Response:
        return await self._counted(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._counted(request, chat=True)

    async def _counted(self, request: Request, chat: bool) -> Response:
        try:
            try:
                return await self._generate(request, chat)
            except (RedisError, TimeoutError) as e:  # Redis down, or slower than redis_timeout_s
                log.warning("request failed on Redis: %r", e)
                raise queue_unavailable() from e
        except APIError as e:
            self.ctx.metrics.failed("unknown", None, e.status)
            raise

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
        started = time.monotonic()
        timing: dict[str, float] = {}
        server_span = get_current_span()
        redis_timeout = ctx.settings.redis_timeout_s
        with span(ctx.tracer, "auth"):
            async with asyncio.timeout(redis_timeout):
                tenant = await ctx.auth.tenant(request)
        body = await read_json(request, ctx.settings.max_body_bytes)
        parsed = protocol.parse_common(body, chat)
        tracing = server_span.is_recording()
        if tracing:
            server_span.set_attributes(
                {
                    "gen_ai.operation.name": "chat" if chat else "text_completion",
                    "gen_ai.provider.name": "loragate",
                    "loragate.tenant": tenant,
                    "gen_ai.request.model": str(parsed.model),
                }
            )
        messages = protocol.chat_messages(body) if chat else []
        async with asyncio.timeout(redis_timeout):
            target, alias = await self._target(parsed, tenant, body, messages)
        serving = ctx.fleet.serving(target.base)
        if not serving:
            raise APIError(
                503,
                f"No worker is serving '{target.base}' right now.",
                code="no_worker",
                headers={"Retry-After": "2"},
            )
        state = serving[0].state
        text: str | None
        with span(ctx.tracer, "tokenize") as tokenize_span:
            tok = ctx.tokenizers.get(state.model_dir)
            if chat:
                text = tok.render_chat(messages)
                prompt = tok.encode(text)
            else:
                text, ids = protocol.completion_prompt(body, tok.vocab_size)
                prompt = ids if ids is not None else tok.encode(text or "")
            tokenize_span.set_attribute("gen_ai.usage.input_tokens", len(prompt))
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
        if tracing:
            server_span.set_attributes(
                {
                    "gen_ai.request.max_tokens": max_tokens,
                    "gen_ai.request.temperature": params.temperature,
                    "gen_ai.request.top_p": params.top_p,
                }
            )
        rid = self._request_id(request, chat)  # the client's; inside loragate the tenant-scoped `qid`
        qid = contracts.scoped_request_id(tenant, rid)
        adapter_key = target.adapter.key if target.adapter else None
        headers = {"x-request-id": rid}
        routed_to: str | None = None
        done: Callable[[OutputEvent], None] = lambda event: None  # noqa: E731
        self._msg = msg = QueuedRequest(
            qid,
            target.base,
            tuple(prompt),
            params,
            adapter=adapter_key,
            tenant=tenant,
            traceparent=inject(server_span),
            operation="chat" if chat else "text_completion",
        )
        self._fp = fp = fingerprint(msg)
        ttl = int(ctx.settings.request_timeout_s) + contracts.REQUEST_RECORD_GRACE_S
        self._store = store = RequestStore(ctx.redis, ttl)
        async with asyncio.timeout(redis_timeout):
            retry = "x-request-id" in request.headers and await store.exists(qid, fp)
        if retry:  # a retry of a request we already have: relay it again (from the start)
            async with asyncio.timeout(redis_timeout):
                events = self._events = await ctx.mux.subscribe(qid)
        else:
            waits = ctx.admission.waited
            charged = await ctx.admission.admit(tenant, target.base, len(prompt), max_tokens)
            # A request that waited for its fair turn may have lost its client meanwhile: drop it here,
            # before a worker reads (and prefills) it. Skipped on the fast path (no wait, no check).
            if ctx.admission.waited != waits and await request.is_disconnected():
                ctx.admission.settle(tenant, target.base, charged, 0, 0)
                raise _client_closed()
            # The same chained, adapter-keyed hashes the worker's prefix cache uses.
            hashes = block_hashes(prompt, state.block_size, adapter_key)
            route = route_request(
                rid,
                tenant,
                target.base,
                adapter_key,
                target.adapter.tenants if target.adapter else (),
                prompt,
                max_tokens,
                hashes,
                state.block_size,
                text or "",
            )
            with span(ctx.tracer, "route") as route_span:
                try:
                    decision = ctx.router.route(route)
                except APIError as e:
                    ctx.admission.settle(tenant, target.base, charged, 0, 0)
                    route_span.set_attribute("loragate.route.error", e.message)
                    raise
                if route_span.is_recording():
                    route_span.set_attributes(decision_attributes(decision))
            assert decision.worker_id is not None
            routed_to = self._routed_to = decision.worker_id
            headers["x-loragate-decision"] = decision.decision_id
            if alias is not None:
                headers["x-loragate-model"] = f"{alias.model}; difficulty {alias.score:.2f}"
            now = time.time()
            msg = replace(msg, deadline=now + ctx.settings.request_timeout_s, enqueued_at=now)
            with span(ctx.tracer, "enqueue", {"loragate.worker": decision.worker_id}):
                # One round trip: the relay's wake-up, the request (with its record) and its decision.
                pipe = ctx.redis.pipeline(transaction=False)
                events = self._events = await ctx.mux.subscribe(qid, pipe=pipe)
                at = len(pipe)
                store.enqueue(pipe, msg, fp, decision.worker_id)
                ctx.decisions.record(decision, rid, pipe)
                try:
                    async with asyncio.timeout(redis_timeout):
                        queued = (await pipe.execute())[at] is not None
                    if not queued:  # a copy with this id (a concurrent try) was queued first: attach to it
                        ctx.router.prefill_done(decision.worker_id, len(prompt))
                        ctx.admission.settle(tenant, target.base, charged, 0, 0)
                        self._note_routed(None)
                        routed_to = None
                        async with asyncio.timeout(redis_timeout):
                            await store.exists(qid, fp)  # 409 when it asked for something else
                except BaseException:  # not queued (Redis failed): undo what routing counted
                    if routed_to is not None:
                        ctx.router.prefill_done(decision.worker_id, len(prompt))
                        ctx.admission.settle(tenant, target.base, charged, 0, 0)
                    self._finish()
                    raise
        if routed_to is not None:  # this handler queued the request: it accounts for it
            ctx.decisions.count(decision)

            def done(event: OutputEvent) -> None:
                now = time.monotonic()
                first = timing.get("first", now)
                itl = (now - first) / (event.completion_tokens - 1) if event.completion_tokens > 1 else None
                ctx.metrics.finished(
                    target.model_id,
                    target.base,
                    adapter_key,
                    first - started,
                    now - started,
                    itl,
                    event.prompt_tokens,
                    event.cached_tokens,
                    event.completion_tokens,
                )
                ctx.decisions.finished(decision, event.cached_tokens)
                ctx.admission.settle(
                    tenant, target.base, charged, event.prompt_tokens, event.completion_tokens
                )
                server_span.set_attributes(
                    {
                        "gen_ai.response.id": rid,
                        "gen_ai.response.model": target.model_id,
                        "gen_ai.response.finish_reasons": [event.finish_reason or ""],
                        "gen_ai.usage.input_tokens": event.prompt_tokens,
                        "gen_ai.usage.output_tokens": event.completion_tokens,
                        "loragate.cached_tokens": event.cached_tokens,
                    }
                )

        # From here on a client that goes away cancels its request, even while it still waits in a queue.
        watcher = asyncio.ensure_future(self._watch(request.receive, events))
        try:
            try:
                first = await self._next(events, target, ctx.settings.first_event_timeout_s)
            except (APIError, ClientGone) as e:
                await self._cancel()
                raise e if isinstance(e, APIError) else _client_closed() from None
            finally:
                if routed_to is not None:
                    ctx.router.prefill_done(routed_to, len(prompt))
            timing["first"] = time.monotonic()
            if first.error is not None:
                self._finish()
                err = first.error
                again = {"Retry-After": "2"} if err.get("status") == 503 else None  # e.g. lost with Redis
                raise APIError(
                    int(err.get("status", 400)), str(err.get("message")), code=err.get("code"), headers=again
                )
            headers["x-loragate-worker"] = first.worker_id
            model_id = target.model_id if parsed.model != AUTO and alias is None else target.base
            if parsed.stream:
                stream = self._sse(
                    rid, model_id, chat, parsed.include_usage, first, events, target, done, watcher
                )
                return EventStreamResponse(stream, headers)
        except BaseException:
            watcher.cancel()
            raise
        try:
            return await self._collect(rid, model_id, chat, first, events, target, headers, done)
        finally:
            watcher.cancel()

    @staticmethod
    async def _watch(receive: Receive, events: EventChannel) -> None:
        """Tell the request's channel when its client disconnects (ASGI `http.disconnect`)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        events.client_gone()

    async def _target(
        self,
        parsed: protocol.ParsedRequest,
        tenant: str,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
    ) -> tuple[Target, AliasChoice | None]:
        """The base model (and adapter) to serve: an alias goes through the difficulty tiers."""
        model = parsed.model
        if isinstance(model, str) and self.ctx.router.is_alias(model):
            text = "\n".join(m["content"] for m in messages) if messages else str(body.get("prompt", ""))
            choice = self.ctx.router.resolve_alias(model, text, parsed.max_tokens or 0)
            return Target(choice.model, None), choice
        return await self.ctx.catalog.resolve(model, tenant), None

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

    async def _next(self, events: EventChannel, target: Target, timeout: float) -> OutputEvent:
        """The next event; fails instead of hanging when no worker can produce it, and raises
        `ClientGone` when the client disconnected. An abort is never handed out: this handler's client
        is still there, so the request is continued."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, "Timed out waiting for the model's output.", code="timeout")
            try:
                event = await events.get(min(_LIVENESS_S, remaining))
            except TimeoutError:
                if not self.ctx.fleet.serving(target.base):
                    raise APIError(
                        503,
                        f"No worker is serving '{target.base}' any more.",
                        code="no_worker",
                        headers={"Retry-After": "2"},
                    ) from None
                continue
            if event.finish_reason != "abort":
                return event
            if events.gone:  # nobody left to continue it for
                raise ClientGone()
            await self._continue(events, target)

    async def _continue(self, events: EventChannel, target: Target) -> None:
        """The request was cut short by a cancel (its client, or another handler's with the same id,
        left): queue it again on the least-loaded worker, which resumes after the tokens already
        streamed, and read on after the abort event (which the queueing deletes). Of several handlers
        that read the same abort, the first queues it; the others read on."""
        if self._continued >= _MAX_CONTINUES:
            raise APIError(
                503,
                "The request was cancelled by its clients too often; please retry.",
                code="request_cancelled",
                headers={"Retry-After": "1"},
            )
        worker = least_loaded(self.ctx.fleet, target.base)
        if worker is None:
            raise APIError(
                503,
                f"No worker is serving '{target.base}' any more.",
                code="no_worker",
                headers={"Retry-After": "2"},
            )
        self._continued += 1
        now = time.time()
        msg = replace(
            self._msg,
            attempt=self._continued,
            deadline=now + self.ctx.settings.request_timeout_s,
            enqueued_at=now,
        )
        worker_id = worker.state.worker_id
        try:
            async with asyncio.timeout(self.ctx.settings.redis_timeout_s):
                entry = await self._store.revive(events.last_id, msg, self._fp, worker_id)
                if entry is not None:
                    self._note_routed(worker_id)
                    log.info("continuing %s on %s after an abort", msg.request_id, worker_id)
                await self.ctx.mux.resume(msg.request_id, events)
        except (RedisError, TimeoutError) as e:
            log.warning("could not continue %s: %r", msg.request_id, e)
            raise queue_unavailable() from e

    def _note_routed(self, worker_id: str | None) -> None:
        """This handler's request now counts on `worker_id`'s load (and no longer on the one before)."""
        if self._routed_to is not None:
            self.ctx.fleet.note_ended(self._routed_to)
        if worker_id is not None:
            self.ctx.fleet.note_enqueued(worker_id)
        self._routed_to = worker_id

    def _finish(self) -> None:
        """Stop relaying the request; it no longer counts on its worker's load here."""
        if self._events is not None:
            self.ctx.mux.unsubscribe(self._msg.request_id, self._events)
        self._note_routed(None)

    async def _cancel(self) -> None:
        """Stop relaying, and cancel the request: dropped from its queue when no worker has read it yet,
        else aborted on its worker (best effort: when Redis cannot take the message, the worker finishes
        the request and its output expires unread)."""
        self._finish()
        qid = self._msg.request_id
        try:
            async with asyncio.timeout(self.ctx.settings.redis_timeout_s):
                if await self._store.cancel(qid):
                    log.info("dropped %s from its queue before it ran", qid)
        except (RedisError, TimeoutError) as e:
            log.warning("could not cancel %s: %r", qid, e)

    async def _collect(
        self,
        rid: str,
        model: str,
        chat: bool,
        first: OutputEvent,
        events: EventChannel,
        target: Target,
        headers: dict[str, str],
        done: Callable[[OutputEvent], None],
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
            await self._cancel()
            raise
        except ClientGone:
            await self._cancel()
            raise _client_closed() from None
        self._finish()
        done(event)
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
        events: EventChannel,
        target: Target,
        on_done: Callable[[OutputEvent], None],
        watcher: asyncio.Future[None],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        event, done = first, False

        def data(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        # Everything ready goes out in one write: the events already relayed, and with the last one the
        # usage chunk and [DONE].
        parts: list[str] = []
        if chat:
            parts.append(
                data(protocol.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
            )
        try:
            while True:
                if event.error is not None:
                    parts.append(data({"error": {k: v for k, v in event.error.items() if k != "status"}}))
                    break
                if event.text or event.is_last:
                    finish = event.finish_reason
                    chunk = (
                        protocol.chat_chunk(
                            rid, model, created, {"content": event.text} if event.text else {}, finish
                        )
                        if chat
                        else protocol.completion_chunk(rid, model, created, event.text, finish)
                    )
                    parts.append(data(chunk))
                if event.is_last:
                    if include_usage:
                        use = protocol.usage(
                            event.prompt_tokens, event.completion_tokens, event.cached_tokens
                        )
                        parts.append(data(protocol.usage_chunk(rid, model, created, chat, use)))
                    break
                if parts and not len(events):  # nothing more is ready: send before waiting
                    yield "".join(parts)
                    parts = []
                try:
                    event = await self._next(events, target, self.ctx.settings.request_timeout_s)
                except APIError as e:
                    parts.append(data(e.body()))
                    break
                except ClientGone:
                    return
            done = event.is_last
            if done:
                on_done(event)
            parts.append("data: [DONE]\n\n")
            yield "".join(parts)
        finally:
            watcher.cancel()
            if done:
                self._finish()
            else:  # the client went away (or the stream failed): free the worker's sequence
                await self._cancel()


def _client_closed() -> APIError:
    return APIError(499, "The client closed the request.", code="client_closed_request")
