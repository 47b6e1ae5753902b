"""Stage parse: who asks (the tenant of the API key) and what (the validated JSON body)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry.trace import Span, get_current_span
from starlette.requests import Request

from gateway import protocol
from gateway.chat_input import chat_messages
from gateway.context import GatewayContext, read_json
from loragate.tracing import span


@dataclass(frozen=True)
class Call:
    chat: bool  # /v1/chat/completions (else /v1/completions)
    tenant: str
    body: dict[str, Any]
    parsed: protocol.ParsedRequest
    messages: list[dict[str, Any]]  # the chat messages ([] for a completion)
    server_span: Span  # the request's own span: later stages add attributes to it

    @property
    def operation(self) -> str:
        return "chat" if self.chat else "text_completion"


async def parse(ctx: GatewayContext, request: Request, chat: bool) -> Call:
    server_span = get_current_span()
    with span(ctx.tracer, "auth"):
        async with asyncio.timeout(ctx.settings.redis_timeout_s):
            tenant = await ctx.auth.tenant(request)
    body = await read_json(request, ctx.settings.max_body_bytes)
    parsed = protocol.parse_common(body, chat)
    call = Call(chat, tenant, body, parsed, [], server_span)
    if server_span.is_recording():  # before the messages are checked: a refused request is named too
        server_span.set_attributes(call_attributes(call))
    return replace(call, messages=chat_messages(body)) if chat else call


def call_attributes(call: Call) -> dict[str, str]:
    return {
        "gen_ai.operation.name": call.operation,
        "gen_ai.provider.name": "loragate",
        "loragate.tenant": call.tenant,
        "gen_ai.request.model": str(call.parsed.model),
    }
