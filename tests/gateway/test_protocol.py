"""OpenAI request parsing: every refusal is a 400 naming its parameter, and what parses is exactly the
sampling the worker will use; response bodies and chunks have the OpenAI shapes."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.chat_input import chat_messages
from gateway.choice_render import ChoiceRenderer, RenderSpec
from gateway.errors import APIError
from gateway.protocol import (
    SEED_MAX,
    SEED_MIN,
    ParsedRequest,
    body,
    chunk,
    completion_prompt,
    completion_prompts,
    parse_common,
    sampling_params,
    usage,
    usage_chunk,
)
from loragate.messages import OutputEvent
from loragate.types import SamplingParams


def _refused(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as e:
        call(*args)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


# (body, chat, param named, words in the message)
PARSE_ERRORS = [
    pytest.param({"n": 129}, False, "n", "between 1 and 128", id="n above 128"),
    pytest.param({"n": 0}, False, "n", "between 1 and 128", id="n zero"),
    pytest.param({"n": 2.5}, False, "n", "integer", id="n a float"),
    pytest.param({"n": True}, True, "n", "integer", id="n a boolean"),
    pytest.param({"best_of": 2}, False, "best_of", "not supported", id="best_of above 1"),
    pytest.param({"functions": [{"name": "f"}]}, True, "functions", "not supported", id="functions"),
    pytest.param({"function_call": "auto"}, True, "function_call", "not supported", id="function_call"),
    pytest.param({"presence_penalty": 3}, True, "presence_penalty", "-2.0 and 2.0", id="penalty range"),
    pytest.param({"stream": "yes"}, False, "stream", "boolean", id="stream not a boolean"),
    pytest.param({"stream_options": [1]}, False, "stream_options", "object", id="stream_options a list"),
    pytest.param({"stop": 3}, False, "stop", "list of non-empty strings", id="stop a number"),
    pytest.param({"stop": ["a", ""]}, False, "stop", "non-empty", id="an empty stop in a list"),
    pytest.param({"stop": ["a", 1]}, False, "stop", "list of non-empty strings", id="a stop not a string"),
    pytest.param({"stop": ""}, False, "stop", "must not be empty", id="empty stop string"),
    pytest.param({"stop": [f"s{i}" for i in range(257)]}, False, "stop", "at most 256", id="257 stops"),
    pytest.param({"stop": ["x" * 257]}, True, "stop", "256 characters", id="a stop of 257 characters"),
    pytest.param({"stop": "x" * 257}, False, "stop", "256 characters", id="a stop string of 257"),
    pytest.param({"max_tokens": 0}, False, "max_tokens", "between 1 and", id="max_tokens zero"),
    pytest.param({"max_tokens": 1.5}, False, "max_tokens", "integer", id="max_tokens a float"),
    pytest.param({"max_tokens": True}, False, "max_tokens", "integer", id="max_tokens a boolean"),
    pytest.param({"max_tokens": 2**31}, False, "max_tokens", "integer", id="max_tokens too big"),
    pytest.param(
        {"max_completion_tokens": 0}, True, "max_completion_tokens", "between 1", id="max_completion_tokens"
    ),
    pytest.param({"seed": SEED_MAX + 1}, False, "seed", "integer", id="seed above u64"),
    pytest.param({"seed": SEED_MIN - 1}, False, "seed", "integer", id="seed below i64"),
    pytest.param({"seed": "7"}, False, "seed", "integer", id="seed a string"),
    pytest.param({"user": 7}, False, "user", "string", id="user not a string"),
    pytest.param({"temperature": 2.5}, False, "temperature", "between 0.0 and 2.0", id="temperature high"),
    pytest.param({"temperature": -0.1}, False, "temperature", "between", id="temperature negative"),
    pytest.param({"temperature": "hot"}, False, "temperature", "number", id="temperature a string"),
    pytest.param({"temperature": False}, False, "temperature", "number", id="temperature a boolean"),
    pytest.param({"top_p": 0}, False, "top_p", "between", id="top_p zero"),
    pytest.param({"top_p": 1.01}, False, "top_p", "between", id="top_p above 1"),
    pytest.param({"top_k": -2}, False, "top_k", "integer between -1", id="top_k below -1"),
    pytest.param({"suffix": "end"}, False, "suffix", "not supported", id="suffix (insertion)"),
    pytest.param({"modalities": ["text", "audio"]}, True, "modalities", "not supported", id="audio out"),
    pytest.param({"audio": {"voice": "x"}}, True, "audio", "not supported", id="audio"),
    pytest.param({"prediction": {"type": "content"}}, True, "prediction", "not supported", id="prediction"),
    pytest.param({"ignore_eos": 1}, False, "ignore_eos", "boolean", id="ignore_eos not a boolean"),
]


@pytest.mark.parametrize(("body", "chat", "param", "words"), PARSE_ERRORS)
def test_parse_common_refuses(body: dict[str, Any], chat: bool, param: str, words: str) -> None:
    error = _refused(parse_common, {"model": "m", **body}, chat)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"logprobs": False, "best_of": 1, "n": 1}, id="neutral values"),
        pytest.param({"logprobs": None, "top_logprobs": None, "tools": None}, id="nulls of logprobs, tools"),
        pytest.param({"presence_penalty": 0, "frequency_penalty": 0.0}, id="zero penalties"),
        pytest.param({"n": None, "stream": None, "stream_options": None, "stop": None}, id="nulls"),
        pytest.param({"response_format": {"type": "text"}, "tool_choice": "none"}, id="text, no tools"),
        pytest.param({"response_format": None, "tool_choice": None, "suffix": None}, id="null options"),
        pytest.param({"suffix": "", "modalities": ["text"], "parallel_tool_calls": True}, id="neutral"),
    ],
)
def test_parse_common_accepts_neutral_values(body: dict[str, Any]) -> None:
    assert parse_common({"model": "m", **body}, chat=True).params["temperature"] == 1.0


def test_parse_common_defaults() -> None:
    assert parse_common({"model": "m"}, chat=False) == ParsedRequest(
        model="m",
        stream=False,
        include_usage=False,
        max_tokens=None,
        params={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": (), "ignore_eos": False},
        user=None,
    )


def test_parse_common_reads_every_field() -> None:
    body = {
        "model": "tiny:a",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 9,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 4,
        "seed": SEED_MIN,
        "stop": ["x", "y"],
        "ignore_eos": True,
        "user": "u1",
    }
    parsed = parse_common(body, chat=False)
    assert (parsed.model, parsed.stream, parsed.include_usage, parsed.max_tokens, parsed.user) == (
        "tiny:a",
        True,
        True,
        9,
        "u1",
    )
    assert parsed.params == {
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 4,
        "seed": SEED_MIN,
        "stop": ("x", "y"),
        "ignore_eos": True,
    }


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        pytest.param({"stop": "end"}, False, ("end",), id="one stop string"),
        pytest.param({"stop": None}, False, (), id="null stop"),
        pytest.param({"stop": []}, False, (), id="empty stop list"),
        pytest.param({"stop": list("abcdefgh")}, False, tuple("abcdefgh"), id="more than four stops"),
        pytest.param({"stop": list("abab")}, False, ("a", "b"), id="duplicates count once"),
        pytest.param(
            {"stop": [f"{i:0256d}" for i in range(256)] * 2},
            False,
            tuple(f"{i:0256d}" for i in range(256)),
            id="256 stops of 256 characters",
        ),
    ],
)
def test_stop_forms(body: dict[str, Any], chat: bool, expected: tuple[str, ...]) -> None:
    assert parse_common(body, chat).params["stop"] == expected


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        pytest.param({"max_completion_tokens": 7}, True, 7, id="chat: max_completion_tokens"),
        pytest.param({"max_completion_tokens": 7, "max_tokens": 3}, True, 3, id="chat: max_tokens wins"),
        pytest.param({"max_completion_tokens": 7}, False, None, id="completions ignore it"),
        pytest.param({"max_tokens": None}, False, None, id="null max_tokens"),
    ],
)
def test_max_tokens(body: dict[str, Any], chat: bool, expected: int | None) -> None:
    assert parse_common(body, chat).max_tokens == expected


def test_null_stream_options_mean_no_usage() -> None:
    assert parse_common({"stream": True, "stream_options": None}, chat=True).include_usage is False


def test_seed_accepts_unsigned_64_bit() -> None:
    assert parse_common({"seed": SEED_MAX}, chat=False).params["seed"] == SEED_MAX


def test_sampling_params_is_what_was_parsed() -> None:
    parsed = parse_common({"temperature": 0.7, "top_k": 3, "stop": "z", "seed": 5}, chat=False)
    assert sampling_params(parsed, 12) == SamplingParams(
        max_tokens=12, temperature=0.7, top_k=3, top_p=1.0, seed=5, stop=("z",)
    )


def test_sampling_params_refuses_what_sampling_refuses() -> None:
    error = _refused(sampling_params, parse_common({}, chat=False), 0)
    assert error.param is None and "max_tokens must be >= 1" in error.message


# --- chat messages ---------------------------------------------------------------------------------------

MESSAGE_ERRORS = [
    pytest.param({}, "messages", "non-empty list", id="missing"),
    pytest.param({"messages": []}, "messages", "non-empty list", id="empty"),
    pytest.param({"messages": "hi"}, "messages", "non-empty list", id="a string"),
    pytest.param({"messages": ["hi"]}, "messages[0].role", "needs a role", id="not an object"),
    pytest.param({"messages": [{"content": "hi"}]}, "messages[0].role", "needs a role", id="no role"),
    pytest.param(
        {"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
        "messages[1].role",
        "needs a role",
        id="unknown role",
    ),
    pytest.param({"messages": [{"role": "user"}]}, "messages[0].content", "string", id="no content"),
    pytest.param(
        {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string", id="content a number"
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
        "only text content parts",
        id="image part",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": ["hi"]}]},
        "messages[0].content[0]",
        "only text content parts",
        id="part not an object",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        "messages[0].content[0].text",
        "must be a string",
        id="text part without text",
    ),
]


@pytest.mark.parametrize(("body", "param", "words"), MESSAGE_ERRORS)
def test_chat_messages_refuses(body: dict[str, Any], param: str, words: str) -> None:
    error = _refused(chat_messages, body)
    assert error.param == param and words in error.message, error.message


def test_chat_messages_normalizes() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "be brief", "name": "ignored"},
            {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": "42"},
            {"role": "system", "content": "s"},
        ]
    }
    assert chat_messages(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
        {"role": "system", "content": "s"},
    ]


# --- completion prompts ----------------------------------------------------------------------------------

PROMPT_ERRORS = [
    pytest.param({}, "string or a list of token ids", id="missing"),
    pytest.param({"prompt": ""}, "must not be empty", id="empty string"),
    pytest.param({"prompt": [""]}, "must not be empty", id="one empty string in a list"),
    pytest.param({"prompt": []}, "string or a list of token ids", id="empty list"),
    pytest.param({"prompt": ["a", "b"]}, "or a list of such prompts", id="a batch is split first"),
    pytest.param({"prompt": [["a", "b"]]}, "string or a list of token ids", id="a batch in a list"),
    pytest.param({"prompt": [1, "a"]}, "string or a list of token ids", id="mixed list"),
    pytest.param({"prompt": [1, True]}, "string or a list of token ids", id="a boolean token"),
    pytest.param({"prompt": [[]]}, "string or a list of token ids", id="one empty token list"),
    pytest.param({"prompt": [3, 100]}, "must be in [0, 100)", id="token id = vocab size"),
    pytest.param({"prompt": [-1]}, "must be in [0, 100)", id="negative token id"),
    pytest.param({"prompt": 7}, "string or a list of token ids", id="a number"),
]


@pytest.mark.parametrize(("body", "words"), PROMPT_ERRORS)
def test_completion_prompt_refuses(body: dict[str, Any], words: str) -> None:
    error = _refused(completion_prompt, body, 100)
    assert error.param == "prompt" and words in error.message, error.message


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        pytest.param("hello", ("hello", None), id="text"),
        pytest.param(["hello"], ("hello", None), id="text in a one-item list"),
        pytest.param([0, 5, 99], (None, [0, 5, 99]), id="token ids"),
        pytest.param([[4, 2]], (None, [4, 2]), id="token ids in a one-item list"),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: tuple[str | None, list[int] | None]) -> None:
    assert completion_prompt({"prompt": prompt}, 100) == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        pytest.param("a", ["a"], id="text: one prompt"),
        pytest.param([1, 2], [[1, 2]], id="token ids: one prompt"),
        pytest.param(["a"], [["a"]], id="a one-item list: one prompt"),
        pytest.param(["a", "b"], ["a", "b"], id="strings"),
        pytest.param([[1], [2, 3]], [[1], [2, 3]], id="token lists"),
        pytest.param(["a", [1]], ["a", [1]], id="both"),
        pytest.param([1, "a"], [[1, "a"]], id="not a batch: refused as one prompt"),
        pytest.param([["a"], "b"], [[["a"], "b"]], id="a nested batch: refused as one prompt"),
    ],
)
def test_completion_prompts_split_a_batch(prompt: object, expected: list[object]) -> None:
    assert completion_prompts({"prompt": prompt}) == expected


def test_completion_prompts_are_bounded() -> None:
    assert len(completion_prompts({"prompt": ["a"] * 256})) == 256
    error = _refused(completion_prompts, {"prompt": ["a"] * 257})
    assert error.param == "prompt" and "at most 256" in error.message


# --- response shapes -------------------------------------------------------------------------------------


def test_usage_totals_and_cached_tokens() -> None:
    assert usage(10, 3, 4) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_bodies_and_chunks() -> None:
    use = usage(1, 2, 0)
    text = ChoiceRenderer(RenderSpec(chat=False))
    text.feed(OutputEvent(text="hi", finish_reason="stop"))
    out = body("cmpl-1", "m", False, [text.final()], use)
    assert out["object"] == "text_completion" and isinstance(out["created"], int)
    assert out["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"] == use and (out["id"], out["model"]) == ("cmpl-1", "m")
    reply = ChoiceRenderer(RenderSpec(chat=True))
    reply.feed(OutputEvent(text="hi", finish_reason="length"))
    chat = body("chat-1", "m", True, [reply.final()], use)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["choices"][0]["finish_reason"] == "length"
    streamed = ChoiceRenderer(RenderSpec(chat=False))
    assert chunk("c", "m", 5, False, streamed.feed(OutputEvent(text="t"))) == {
        "id": "c",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "text": "t", "logprobs": None, "finish_reason": None}],
    }
    delta = ChoiceRenderer(RenderSpec(chat=True))
    assert chunk("c", "m", 5, True, delta.feed(OutputEvent(text="t", finish_reason="stop")))["choices"] == [
        {"index": 0, "delta": {"content": "t"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert delta.feed(OutputEvent()) == []
    assert chunk("c", "m", 5, True, [])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(
    ("chat", "kind"), [pytest.param(True, "chat.completion.chunk", id="chat"), (False, "text_completion")]
)
def test_usage_chunk(chat: bool, kind: str) -> None:
    assert usage_chunk("c", "m", 5, chat, {"total_tokens": 3}) == {
        "id": "c",
        "object": kind,
        "created": 5,
        "model": "m",
        "choices": [],
        "usage": {"total_tokens": 3},
    }


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (None, 0), (5, 5)], ids=str)
def test_top_k_minus_one_or_zero_is_off(top_k: int | None, expected: int) -> None:
    assert parse_common({"model": "m", "top_k": top_k}, chat=False).params["top_k"] == expected


# --- sampling parameters beyond OpenAI's basics: valid, invalid, null ------------------------------------

# (body, chat, the SamplingParams fields it sets)
SAMPLING_VALID = [
    pytest.param({"presence_penalty": 0.5}, False, {"presence_penalty": 0.5}, id="presence_penalty"),
    pytest.param({"frequency_penalty": -2}, True, {"frequency_penalty": -2.0}, id="frequency_penalty low"),
    pytest.param({"repetition_penalty": 1.3}, False, {"repetition_penalty": 1.3}, id="repetition_penalty"),
    pytest.param({"min_p": 0.1}, False, {"min_p": 0.1}, id="min_p"),
    pytest.param({"min_tokens": 3}, True, {"min_tokens": 3}, id="min_tokens"),
    pytest.param(
        {"logit_bias": {"7": 5, "3": -100}}, True, {"logit_bias": ((3, -100.0), (7, 5.0))}, id="bias"
    ),
    pytest.param({"logit_bias": {}}, True, {"logit_bias": ()}, id="empty logit_bias"),
    pytest.param({"stop_token_ids": [2, 9]}, False, {"stop_token_ids": (2, 9)}, id="stop_token_ids"),
    pytest.param(
        {"stop_token_ids": [2, 9, 2] + list(range(256)) * 3},
        False,
        {"stop_token_ids": (2, 9, *(i for i in range(256) if i not in (2, 9)))},
        id="stop_token_ids: 256 distinct, duplicates count once",
    ),
    pytest.param(
        {"logit_bias": {str(i): 1 for i in range(300)}},
        True,
        {"logit_bias": tuple((i, 1.0) for i in range(300))},
        id="300 biases",
    ),
    pytest.param({"logprobs": True}, True, {"logprobs": 0}, id="chat logprobs"),
    pytest.param({"logprobs": True, "top_logprobs": 20}, True, {"logprobs": 20}, id="chat top_logprobs 20"),
    pytest.param({"logprobs": False}, True, {}, id="chat logprobs off"),
    pytest.param({"logprobs": 5}, False, {"logprobs": 5}, id="completion logprobs 5"),
    pytest.param({"logprobs": 0}, False, {"logprobs": 0}, id="completion logprobs 0"),
    pytest.param({"logprobs": 2, "echo": True}, False, {"logprobs": 2, "prompt_logprobs": 2}, id="echo"),
    pytest.param({"echo": True}, False, {}, id="echo without logprobs"),
    pytest.param({"skip_special_tokens": False}, True, {"skip_special_tokens": False}, id="keep special"),
    pytest.param({"skip_special_tokens": True}, False, {}, id="skip special: the default"),
]

NULLS = [
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "echo",
    "skip_special_tokens",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "best_of",
    "functions",
    "function_call",
]


@pytest.mark.parametrize(("body", "chat", "fields"), SAMPLING_VALID)
def test_new_sampling_parameters_reach_sampling_params(
    body: dict[str, Any], chat: bool, fields: dict[str, Any]
) -> None:
    parsed = parse_common({"model": "m", **body}, chat)
    extra = {k: v for k, v in parsed.params.items() if k not in DEFAULT_PARAMS}
    assert extra == fields
    params = sampling_params(parsed, 16)
    assert all(getattr(params, k) == v for k, v in fields.items())


DEFAULT_PARAMS = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


@pytest.mark.parametrize("name", NULLS)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_explicit_null_is_not_given(name: str, chat: bool) -> None:
    parsed = parse_common({"model": "m", name: None}, chat)
    assert parsed == parse_common({"model": "m"}, chat)


SAMPLING_ERRORS = [
    pytest.param({"frequency_penalty": 2.5}, False, "frequency_penalty", "-2.0 and 2.0", id="frequency high"),
    pytest.param({"presence_penalty": "1"}, False, "presence_penalty", "number", id="presence a string"),
    pytest.param({"repetition_penalty": 0}, False, "repetition_penalty", "above 0", id="repetition zero"),
    pytest.param(
        {"repetition_penalty": -1}, False, "repetition_penalty", "above 0", id="repetition negative"
    ),
    pytest.param({"repetition_penalty": True}, False, "repetition_penalty", "above 0", id="repetition bool"),
    pytest.param({"min_p": 1.5}, False, "min_p", "between 0.0 and 1.0", id="min_p above 1"),
    pytest.param({"min_p": -0.1}, False, "min_p", "between", id="min_p negative"),
    pytest.param({"min_tokens": -1}, False, "min_tokens", "integer between 0", id="min_tokens negative"),
    pytest.param({"min_tokens": 1.5}, False, "min_tokens", "integer", id="min_tokens a float"),
    pytest.param({"skip_special_tokens": 0}, True, "skip_special_tokens", "boolean", id="skip special 0"),
    pytest.param({"logit_bias": [1, 2]}, True, "logit_bias", "object", id="logit_bias a list"),
    pytest.param({"logit_bias": {"a": 1}}, True, "logit_bias", "not a token id", id="bias key not an id"),
    pytest.param({"logit_bias": {"-1": 1}}, True, "logit_bias", "not a token id", id="bias key negative"),
    pytest.param({"logit_bias": {"1": 101}}, True, "logit_bias", "-100 and 100", id="bias above 100"),
    pytest.param({"logit_bias": {"1": "x"}}, True, "logit_bias", "-100 and 100", id="bias a string"),
    pytest.param({"logit_bias": {"1": True}}, True, "logit_bias", "-100 and 100", id="bias a boolean"),
    pytest.param({"stop_token_ids": 3}, False, "stop_token_ids", "list of token ids", id="stop ids a number"),
    pytest.param(
        {"stop_token_ids": [-1]}, False, "stop_token_ids", "list of token ids", id="stop id negative"
    ),
    pytest.param({"stop_token_ids": [True]}, False, "stop_token_ids", "list of token ids", id="stop id bool"),
    pytest.param(
        {"stop_token_ids": list(range(257))}, False, "stop_token_ids", "at most 256", id="257 stop ids"
    ),
    pytest.param(
        {"logit_bias": {str(i): 1 for i in range(301)}}, True, "logit_bias", "at most 300", id="301 biases"
    ),
    pytest.param({"logprobs": 1}, True, "logprobs", "boolean", id="chat logprobs a number"),
    pytest.param({"top_logprobs": 3}, True, "top_logprobs", "needs 'logprobs'", id="top without logprobs"),
    pytest.param(
        {"logprobs": False, "top_logprobs": 3}, True, "top_logprobs", "needs", id="top with logprobs false"
    ),
    pytest.param({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "0 and 20", id="top above 20"),
    pytest.param({"logprobs": True, "top_logprobs": -1}, True, "top_logprobs", "0 and 20", id="top negative"),
    pytest.param({"logprobs": 6}, False, "logprobs", "between 0 and 5", id="completion logprobs above 5"),
    pytest.param({"logprobs": True}, False, "logprobs", "integer", id="completion logprobs a boolean"),
    pytest.param({"echo": 1}, False, "echo", "boolean", id="echo not a boolean"),
    pytest.param({"echo": True}, True, "echo", "/v1/completions", id="echo in chat"),
    pytest.param(
        {"parallel_tool_calls": "yes"}, True, "parallel_tool_calls", "boolean", id="parallel a string"
    ),
]


@pytest.mark.parametrize(("body", "chat", "param", "words"), SAMPLING_ERRORS)
def test_new_sampling_parameters_refused(body: dict[str, Any], chat: bool, param: str, words: str) -> None:
    error = _refused(parse_common, {"model": "m", **body}, chat)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"response_format": {"type": "json_object"}}, id="response_format"),
        pytest.param({"guided_regex": "a+"}, id="guided_regex"),
        pytest.param(
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            id="forced tool call",
        ),
    ],
)
def test_a_guide_reaches_sampling_params(body: dict[str, Any]) -> None:
    parsed = parse_common({"model": "m", **body}, chat=True)
    assert sampling_params(parsed, 8).guide == parsed.params["guide"] != ""


def test_a_forced_tool_call_and_a_structured_output_are_refused_together() -> None:
    body = {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    error = _refused(parse_common, body, True)
    assert error.param == "tool_choice" and "response_format" in error.message


def test_auto_tools_and_a_structured_output_go_together() -> None:
    body = {"tools": [{"type": "function", "function": {"name": "f"}}], "guided_choice": ["a", "b"]}
    parsed = parse_common(body, chat=True)
    assert parsed.tools is not None and parsed.tools.choice == "auto" and "choice" in parsed.params["guide"]


# --- chat messages with tool calls ----------------------------------------------------------------------

TOOL_MESSAGE_ERRORS = [
    pytest.param(
        {"role": "assistant", "content": None}, "messages[0].content", "string", id="null content, no calls"
    ),
    pytest.param(
        {"role": "assistant", "content": None, "tool_calls": {"id": "1"}},
        "messages[0].tool_calls",
        "list of tool calls",
        id="tool_calls not a list",
    ),
    pytest.param(
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]},
        "messages[0].tool_calls[0]",
        "arguments",
        id="call without arguments",
    ),
    pytest.param(
        {
            "role": "assistant",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}],
        },
        "messages[0].tool_calls[0]",
        "arguments",
        id="arguments not a string",
    ),
    pytest.param(
        {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]},
        "messages[0].tool_calls[0]",
        "'function'",
        id="not a function call",
    ),
    pytest.param(
        {"role": "tool", "content": "1", "tool_call_id": 5},
        "messages[0].tool_call_id",
        "string",
        id="tool_call_id a number",
    ),
    pytest.param(
        {"role": "tool", "content": None}, "messages[0].content", "string", id="tool without content"
    ),
]


@pytest.mark.parametrize(("message", "param", "words"), TOOL_MESSAGE_ERRORS)
def test_chat_messages_refuses_malformed_tool_turns(message: dict[str, Any], param: str, words: str) -> None:
    error = _refused(chat_messages, {"messages": [message]})
    assert error.param == param and words in error.message, error.message


def test_chat_messages_keep_tool_calls_and_results() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "call_1"},
            {"role": "assistant", "content": None, "function_call": {"name": "g", "arguments": "{}"}},
            {"role": "function", "name": "g", "content": "ok"},
        ]
    }
    assert chat_messages(body) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "g", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "ok", "name": "g"},
    ]


# --- vLLM / OpenAI fields this server cannot honour: refused unless neutral, never ignored ---------------

# (name, a value that would change the result, a neutral value or None, the endpoints it applies to)
NOT_HONOURED = [
    ("allowed_token_ids", [1, 2], None, (True, False)),
    ("bad_words", ["x"], [], (True, False)),
    ("include_stop_str_in_output", True, False, (True, False)),
    ("prompt_logprobs", 1, None, (True, False)),
    ("top_logprobs", 2, None, (False,)),
    ("use_beam_search", True, False, (True, False)),
    ("length_penalty", 0.5, 1, (True, False)),
    ("early_stopping", True, False, (True, False)),
    ("truncate_prompt_tokens", 10, None, (True, False)),
    ("spaces_between_special_tokens", False, True, (True, False)),
    ("logits_processors", ["x"], [], (True, False)),
    ("return_tokens_as_token_ids", True, False, (True, False)),
    ("return_token_ids", True, False, (True, False)),
    ("priority", 1, 0, (True, False)),
    ("vllm_xargs", {"a": 1}, {}, (True, False)),
    ("guided_whitespace_pattern", " ", None, (True, False)),
    ("guided_decoding_backend", "outlines", "xgrammar", (True, False)),
    ("chat_template", "{{ x }}", None, (True, False)),
    ("chat_template_kwargs", {"enable_thinking": False}, {}, (True, False)),
    ("continue_final_message", True, False, (True, False)),
    ("add_generation_prompt", False, True, (True, False)),
    ("add_special_tokens", True, False, (True, False)),
    ("documents", [{"text": "d"}], [], (True, False)),
    ("mm_processor_kwargs", {"a": 1}, {}, (True, False)),
]


@pytest.mark.parametrize(
    ("name", "value", "chat"),
    [
        pytest.param(n, v, chat, id=f"{n} on {'chat' if chat else 'completions'}")
        for n, v, _, on in NOT_HONOURED
        for chat in on
    ],
)
def test_a_field_not_honoured_is_refused(name: str, value: Any, chat: bool) -> None:
    body = {"model": "m", name: value, **({"logprobs": True} if name == "top_logprobs" and chat else {})}
    error = _refused(parse_common, body, chat)
    assert error.param == name and "not supported" in error.message, error.message


@pytest.mark.parametrize(
    ("name", "neutral"),
    [pytest.param(n, neutral, id=n) for n, _, neutral, _ in NOT_HONOURED if neutral is not None],
)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_neutral_value_of_a_field_not_honoured_is_accepted(name: str, neutral: Any, chat: bool) -> None:
    assert parse_common({"model": "m", name: neutral}, chat) == parse_common({"model": "m"}, chat)


@pytest.mark.parametrize(("name", "value"), [("priority", False), ("length_penalty", True)])
def test_a_boolean_is_not_a_neutral_number(name: str, value: bool) -> None:
    assert _refused(parse_common, {"model": "m", name: value}, True).param == name


def test_harmless_extras_clients_send_still_pass() -> None:
    extras = {
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "reasoning_effort": "low",
        "safety_identifier": "u",
        "request_id": "r",
        "cache_salt": "s",
    }
    for chat in (True, False):
        assert parse_common({"model": "m", **extras}, chat) == parse_common({"model": "m"}, chat)
