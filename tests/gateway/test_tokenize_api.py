"""vLLM's `POST /tokenize` and `POST /detokenize` on a real gateway (uvicorn on 127.0.0.1, real Redis, the
tiny model's real tokenizer): a prompt and chat messages tokenize as generation tokenizes them, token
ids detokenize back, the model is resolved with the key's tenant rules (another tenant's adapter is 404),
and every refusal is the OpenAI error object with its status."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.tokenize import load_tokenizer
from loragate import contracts
from loragate.messages import AdapterRecord, QueuedRequest, WorkerState
from tests.gateway.live_gateway import connect, error_of, live_gateway
from worker.modelzoo.make import ZooPaths

ALICE, BOB = {"Authorization": "Bearer sk-test-alice"}, {"Authorization": "Bearer sk-test-bob"}
BASE = "tok-base"
SHARED = AdapterRecord("tok-shared", BASE, "/adapters/shared")
BOBS = AdapterRecord("tok-bobs", BASE, "/adapters/bobs", tenants=("bob",))
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]


@pytest.fixture
def gateway(redis_url: str, zoo: ZooPaths) -> Iterator[str]:
    r = redis.Redis.from_url(redis_url)
    state = WorkerState("tok-w1", BASE, str(zoo.base("tiny")), 1536, updated_at=time.time())
    r.set(contracts.worker_state(BASE, state.worker_id), state.to_json(), ex=60)
    for rec in (SHARED, BOBS):
        r.hset(contracts.ADAPTERS, rec.key, rec.to_json())
    try:
        with live_gateway(redis_url) as url:
            deadline = time.monotonic() + 10
            while post(url, "/tokenize", {"model": BASE, "prompt": "x"}).status_code != 200:
                assert time.monotonic() < deadline  # the fleet view refreshes every half second
                time.sleep(0.1)
            yield url
    finally:
        r.delete(contracts.worker_state(BASE, state.worker_id))
        r.hdel(contracts.ADAPTERS, SHARED.key, BOBS.key)
        r.close()


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] = ALICE) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=10)


@pytest.mark.parametrize("model", [BASE, SHARED.key, "tok-shared"], ids=["base", "base:adapter", "adapter"])
def test_a_prompt_round_trips(gateway: str, zoo: ZooPaths, model: str) -> None:
    tok = load_tokenizer(zoo.base("tiny"))
    text = "def parse_args(argv):\n    return argv[1:]"
    got = post(gateway, "/tokenize", {"model": model, "prompt": text})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1536 and body["token_strs"] is None
    back = post(gateway, "/detokenize", {"model": model, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_chat_messages_tokenize_as_the_chat_template_renders_them(gateway: str, zoo: ZooPaths) -> None:
    tok = load_tokenizer(zoo.base("tiny"))
    for generation in (True, False):
        got = post(
            gateway, "/tokenize", {"model": BASE, "messages": MESSAGES, "add_generation_prompt": generation}
        ).json()
        assert got["tokens"] == tok.encode(tok.render_chat(MESSAGES, generation))
    default = post(gateway, "/tokenize", {"model": BASE, "messages": MESSAGES}).json()
    assert default["tokens"] == tok.encode(tok.render_chat(MESSAGES))  # as /v1/chat/completions renders
    text = post(gateway, "/detokenize", {"model": BASE, "tokens": default["tokens"]}).json()["prompt"]
    assert text == tok.render_chat(MESSAGES)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
WITH_TOOLS = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def queued_prompt(redis_url: str, gateway: str, body: dict[str, Any]) -> tuple[int, ...]:
    """The prompt token ids a chat request is queued with (no worker answers: the client then leaves, as
    soon as the request is queued)."""
    r = redis.Redis.from_url(redis_url)
    queue = contracts.queue(BASE, "tok-w1")
    r.delete(queue)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {ALICE['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    try:
        with connect(gateway) as sock:
            sock.sendall(head.encode() + payload)
            deadline = time.monotonic() + 10
            while not (entries := r.xrange(queue)):
                assert time.monotonic() < deadline, "the chat request was not queued"
                time.sleep(0.02)
        return QueuedRequest.from_json(entries[0][1][contracts.QUEUE_FIELD_BYTES]).prompt_token_ids
    finally:
        r.delete(queue)
        r.close()


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "required"}],
    ids=["tool calls and results", "tools offered", "a forced call"],
)
def test_the_count_is_a_chat_requests_prompt_tokens(
    redis_url: str, gateway: str, extra: dict[str, Any]
) -> None:
    """Tool calls and results (and the tools offered) are folded into the prompt as generation folds
    them, so /tokenize counts what /v1/chat/completions will report as `prompt_tokens`."""
    body = {"model": BASE, "messages": WITH_TOOLS, **extra}
    got = post(gateway, "/tokenize", body)
    assert got.status_code == 200, got.text
    assert tuple(got.json()["tokens"]) == queued_prompt(redis_url, gateway, {**body, "max_tokens": 4})


def test_token_strings_on_request(gateway: str) -> None:
    got = post(gateway, "/tokenize", {"model": BASE, "prompt": "hello world", "return_token_strs": True})
    body = got.json()
    assert len(body["token_strs"]) == body["count"] and "".join(body["token_strs"]).endswith("world")


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [
        pytest.param(
            "/tokenize", {"model": BOBS.key, "prompt": "x"}, ALICE, 404, "model", id="another's adapter"
        ),
        pytest.param(
            "/detokenize", {"model": "tok-bobs", "tokens": [1]}, ALICE, 404, "model", id="another's by name"
        ),
        pytest.param(
            "/tokenize", {"model": "never-served", "prompt": "x"}, ALICE, 404, "model", id="unknown"
        ),
        pytest.param("/tokenize", {"model": "auto", "prompt": "x"}, ALICE, 400, "model", id="auto"),
        pytest.param("/tokenize", {"prompt": "x"}, ALICE, 400, "model", id="no model"),
        pytest.param("/tokenize", {"model": BASE, "prompt": "x"}, {}, 401, None, id="no key"),
        pytest.param("/detokenize", {"model": BASE, "tokens": [1]}, {}, 401, None, id="no key (detokenize)"),
        pytest.param("/tokenize", {"model": BASE}, ALICE, 400, "prompt", id="no prompt"),
        pytest.param(
            "/tokenize", {"model": BASE, "prompt": [1, 2]}, ALICE, 400, "prompt", id="prompt not text"
        ),
        pytest.param(
            "/tokenize", {"model": BASE, "prompt": "x", "messages": MESSAGES}, ALICE, 400, "prompt", id="both"
        ),
        pytest.param(
            "/tokenize",
            {"model": BASE, "messages": [{"role": "wizard", "content": "x"}]},
            ALICE,
            400,
            "messages[0].role",
            id="a bad message",
        ),
        pytest.param(
            "/tokenize",
            {"model": BASE, "messages": MESSAGES, "chat_template": "{{ x }}"},
            ALICE,
            400,
            "chat_template",
            id="a chat template of its own",
        ),
        pytest.param(
            "/tokenize",
            {"model": BASE, "prompt": "x", "add_special_tokens": "yes"},
            ALICE,
            400,
            "add_special_tokens",
            id="a flag not a boolean",
        ),
        pytest.param(
            "/detokenize", {"model": BASE, "tokens": [1, 10**9]}, ALICE, 400, "tokens", id="id too big"
        ),
        pytest.param("/detokenize", {"model": BASE, "tokens": [-1]}, ALICE, 400, "tokens", id="negative id"),
        pytest.param("/detokenize", {"model": BASE, "tokens": "12"}, ALICE, 400, "tokens", id="not a list"),
        pytest.param(
            "/detokenize", {"model": BASE, "tokens": [True]}, ALICE, 400, "tokens", id="a boolean id"
        ),
    ],
)
def test_refusals(
    gateway: str, path: str, body: dict[str, Any], headers: dict[str, str], status: int, param: str | None
) -> None:
    got = post(gateway, path, body, headers)
    assert got.status_code == status, got.text
    error = error_of(got.content)
    if param is not None:
        assert error["param"] == param, error
    if status == 404:
        assert error["code"] == "model_not_found"


def test_bobs_adapter_is_his_to_tokenize(gateway: str) -> None:
    assert post(gateway, "/tokenize", {"model": BOBS.key, "prompt": "x"}, BOB).status_code == 200
