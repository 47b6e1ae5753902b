"""Stage resolve: a served base model resolves with its live workers; an unknown one is 404; the
difficulty estimator reads the messages or the prompt."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.parse import Call
from gateway.pipeline.resolve import alias_text, resolve
from tests.gateway.pipeline.live_context import BASE, WORKERS, call, run


@pytest.mark.parametrize(
    ("messages", "body", "expected"),
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}, "a\nb"),
        ([], {"prompt": "p"}, "p"),
        ([], {"prompt": [1, 2]}, "[1, 2]"),
        ([], {}, ""),
    ],
    ids=["messages joined", "prompt", "token ids as text", "nothing"],
)
def test_alias_text(messages: list[dict[str, Any]], body: dict[str, Any], expected: str) -> None:
    asked = Call(bool(messages), "t", body, call().parsed, messages, call().server_span)
    assert alias_text(asked) == expected


def test_a_served_base_resolves_with_its_workers(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        got = await resolve(ctx, call())
        assert got.target.base == BASE and got.alias is None and got.target.adapter is None
        assert sorted(w.state.worker_id for w in got.serving) == sorted(WORKERS)
        assert got.max_model_len == 2048 and got.serving[0].state.model == BASE

    run(redis_url, body)


@pytest.mark.parametrize(("model", "status"), [("nope", 404), ("", 400)], ids=["unknown", "empty"])
def test_a_model_nobody_serves(model: str, status: int, redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        with pytest.raises(APIError) as e:
            await resolve(ctx, call(model=model))
        assert e.value.status == status

    run(redis_url, body)
