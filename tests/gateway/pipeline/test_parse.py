"""Stage parse: the API key names the tenant, the body is validated, chat messages are read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.parse import call_attributes, parse
from tests.gateway.pipeline.live_context import BASE, TENANT, call, http_request, run

KEY = {"authorization": "Bearer key-alice"}


@pytest.mark.parametrize(
    ("chat", "body", "messages"),
    [
        (False, {"model": BASE, "prompt": "hi"}, []),
        (True, {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}, ["hi"]),
    ],
    ids=["completion", "chat"],
)
def test_a_valid_call(chat: bool, body: dict[str, Any], messages: list[str], redis_url: str) -> None:
    async def run_parse(ctx: GatewayContext) -> None:
        got = await parse(ctx, http_request(KEY, body=json.dumps(body).encode()), chat)
        assert (got.tenant, got.chat, got.parsed.model) == (TENANT, chat, BASE)
        assert [m["content"] for m in got.messages] == messages
        assert got.operation == ("chat" if chat else "text_completion")

    run(redis_url, run_parse)


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ({}, b'{"model": "tiny", "prompt": "hi"}', 401),
        ({"authorization": "Bearer wrong"}, b'{"model": "tiny", "prompt": "hi"}', 401),
        (KEY, b"{not json", 400),
        (KEY, b'["a list"]', 400),
        (KEY, b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400),
    ],
    ids=["no key", "unknown key", "not JSON", "not an object", "bad parameter"],
)
def test_a_refused_call(headers: dict[str, str], body: bytes, status: int, redis_url: str) -> None:
    async def run_parse(ctx: GatewayContext) -> None:
        with pytest.raises(APIError) as e:
            await parse(ctx, http_request(headers, body=body), chat=False)
        assert e.value.status == status

    run(redis_url, run_parse)


def test_call_attributes() -> None:
    assert call_attributes(call()) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "loragate",
        "loragate.tenant": TENANT,
        "gen_ai.request.model": BASE,
    }
