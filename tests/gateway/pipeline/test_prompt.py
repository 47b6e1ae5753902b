"""Stage tokenize: the completion budget within the model's context, the token ids and min_tokens only the
tokenizer's stage can check, and the render spec a request's answer gets."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.trace import INVALID_SPAN

from gateway.errors import APIError
from gateway.pipeline.parse import Call
from gateway.pipeline.prompt import Prompt, check_sampling, completion_budget, render_spec
from gateway.protocol import parse_common, sampling_params
from gateway.tokenize import load_tokenizer
from worker.modelzoo.make import ZooPaths


@pytest.mark.parametrize(
    ("prompt", "asked", "limit", "chat", "expected"),
    [
        (10, 5, 100, False, 5),
        (10, None, 100, False, 16),
        (10, None, 100, True, 90),
        (10, 90, 100, True, 90),
        (90, None, 100, False, None),
        (10, 91, 100, True, None),
    ],
    ids=[
        "asked",
        "completion default 16",
        "chat: the rest of the context",
        "exactly fits",
        "default does not fit",
        "one token over",
    ],
)
def test_completion_budget(
    prompt: int, asked: int | None, limit: int, chat: bool, expected: int | None
) -> None:
    if expected is not None:
        assert completion_budget(prompt, asked, limit, chat) == expected
        return
    with pytest.raises(APIError) as e:
        completion_budget(prompt, asked, limit, chat)
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
    assert e.value.param == ("messages" if chat else "prompt")


# --- what only the tokenizer can check, and how the answer shows ------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"logit_bias": {"100": 1}}, "logit_bias", id="bias id = vocab size"),
        pytest.param({"stop_token_ids": [3, 100]}, "stop_token_ids", id="stop id = vocab size"),
        pytest.param({"min_tokens": 9}, "min_tokens", id="min_tokens above max_tokens"),
        pytest.param({"logit_bias": {"99": 1}, "stop_token_ids": [99], "min_tokens": 8}, None, id="all fit"),
    ],
)
def test_check_sampling(body: dict[str, Any], param: str | None) -> None:
    params = parse_common(body, chat=False).params
    if param is None:
        check_sampling(params, 8, 100)
        return
    with pytest.raises(APIError) as e:
        check_sampling(params, 8, 100)
    assert (e.value.status, e.value.param) == (400, param)


def call_of(body: dict[str, Any], chat: bool) -> Call:
    return Call(chat, "t", body, parse_common(body, chat), [], INVALID_SPAN)


def prompt_of(call: Call, text: str | None, ids: list[int]) -> Prompt:
    return Prompt(text, tuple(ids), 8, sampling_params(call.parsed, 8))


TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("body", "chat", "logprobs", "echo", "echo_first", "tools"),
    [
        pytest.param({}, True, False, None, None, None, id="plain chat"),
        pytest.param({"logprobs": True}, True, True, None, None, None, id="chat logprobs"),
        pytest.param({"tools": [TOOL]}, True, False, None, None, frozenset({"f"}), id="tools read back"),
        pytest.param(
            {"tools": [TOOL], "tool_choice": "none"}, True, False, None, None, None, id="tools: none"
        ),
        pytest.param({"logprobs": 1}, False, True, None, None, None, id="completion logprobs"),
        pytest.param({"echo": True}, False, False, "Hello there", None, None, id="echo"),
        pytest.param({"echo": True, "logprobs": 0}, False, True, "Hello there", "first", None, id="echo lp"),
    ],
)
def test_render_spec(
    zoo: ZooPaths,
    body: dict[str, Any],
    chat: bool,
    logprobs: bool,
    echo: str | None,
    echo_first: str | None,
    tools: frozenset[str] | None,
) -> None:
    tok = load_tokenizer(zoo.base("tiny"))
    call = call_of(body, chat)
    ids = tok.encode("Hello there")
    for text in ("Hello there", None):  # a prompt given as text, or as token ids
        spec = render_spec(call, tok, prompt_of(call, text, ids))
        assert (spec.chat, spec.echo, spec.tools) == (chat, echo, tools)
        assert (spec.logprobs == tok.token_text) is logprobs
        assert spec.echo_first == (ids[0] if echo_first else None)


@pytest.mark.parametrize(
    ("body", "parallel"),
    [
        pytest.param({"tools": [TOOL]}, True, id="default"),
        pytest.param({"tools": [TOOL], "parallel_tool_calls": False}, False, id="parallel_tool_calls false"),
        pytest.param({"parallel_tool_calls": False}, True, id="no tools"),
    ],
)
def test_render_spec_keeps_one_call_without_parallel_calls(
    zoo: ZooPaths, body: dict[str, Any], parallel: bool
) -> None:
    tok = load_tokenizer(zoo.base("tiny"))
    call = call_of(body, True)
    assert render_spec(call, tok, prompt_of(call, "Hi", tok.encode("Hi"))).parallel_tools is parallel
