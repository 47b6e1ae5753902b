"""Stage job: the client's request id is checked or made, and names a tenant-scoped request."""

from __future__ import annotations

import re

import pytest

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.job import make_job, request_id
from loragate import contracts
from tests.gateway.pipeline.live_context import TENANT, call, http_request, prompt, resolved, run


@pytest.mark.parametrize(
    ("headers", "chat", "expected"),
    [
        ({}, True, r"chatcmpl-[0-9a-f]{32}"),
        ({}, False, r"cmpl-[0-9a-f]{32}"),
        ({"x-request-id": "req-0001"}, True, r"req-0001"),
        ({"x-request-id": "a.b_c:d-" + "e" * 120}, False, r"a\.b_c:d-e{120}"),
    ],
    ids=["chat made", "completion made", "given", "given, 128 characters"],
)
def test_request_id(headers: dict[str, str], chat: bool, expected: str) -> None:
    assert re.fullmatch(expected, request_id(headers, chat))


@pytest.mark.parametrize(
    "given", ["short", "x" * 129, "has space1", "slash/in/it", "ünïcode-id"], ids=str.__len__
)
def test_a_bad_request_id_is_refused(given: str) -> None:
    with pytest.raises(APIError) as e:
        request_id({"x-request-id": given}, chat=False)
    assert e.value.status == 400


def test_the_job_names_the_tenant_scoped_request_and_is_no_retry_when_new(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        given = make_job(ctx, http_request({"x-request-id": "req-0001"}), call(), resolved(ctx), prompt())
        made = make_job(ctx, http_request(), call(), resolved(ctx), prompt())
        assert given.qid == contracts.scoped_request_id(TENANT, "req-0001") and given.given_id
        assert made.request_id.startswith("cmpl-") and not made.given_id
        assert given.message.prompt_token_ids == prompt().token_ids and given.message.tenant == TENANT
        assert not await given.is_retry(ctx) and not await made.is_retry(ctx)

    run(redis_url, body)
