"""Model families' own tool-call syntax (`gateway.tool_formats`): which template speaks which, the calls
read back from each (whole or streamed in any split, the same), the forced call in each syntax, call ids
as each template requires them, and the conversation rendered as transformers renders it."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.chat_input import chat_messages
from gateway.tokenize import load_tokenizer
from gateway.tool_calls import ParsedCall
from gateway.tool_calls_json import MAX_CALL_CHARS, make_parser, parse_output
from gateway.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, detect
from gateway.tools import parse_tools, prompt_messages, tool_params
from loragate.guides import Guide
from loragate.types import SamplingParams
from tests.tool_models import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, family_model
from worker.modelzoo.make import ZooPaths

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        pytest.param(None, None, id="no template"),
        pytest.param("{{ messages[0].content }}", None, id="no tools"),
        pytest.param(MISTRAL_TEMPLATE, MISTRAL, id="mistral"),
        pytest.param("{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]{{ args }}", None, id="mistral name-args form"),
        pytest.param(LLAMA3_TEMPLATE, LLAMA3_JSON, id="llama3 (headers and parameters)"),
        pytest.param("{% if tools %}<|python_tag|>{% endif %}", LLAMA3_JSON, id="llama3 python tag"),
        pytest.param("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}", HERMES, id="hermes"),
        pytest.param("{% for t in tools %}<call>{{ t }}</call>{% endfor %}", None, id="unknown syntax"),
    ],
)
def test_detect(template: str | None, expected: ToolFormat | None) -> None:
    assert detect(template) == expected


# --- reading calls back ---------------------------------------------------------------------------------

# (format, output, content, calls as (name, arguments JSON))
OUTPUTS = [
    pytest.param(
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}')],
        id="llama3 one call",
    ),
    pytest.param(
        LLAMA3_JSON,
        ' <|python_tag|>{"name": "get_time", "arguments": {}}',
        "",
        [("get_time", "{}")],
        id="llama3 after the python tag, arguments key",
    ),
    pytest.param(
        LLAMA3_JSON,
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}\n',
        "",
        [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')],
        id="llama3 two calls",
    ),
    pytest.param(
        LLAMA3_JSON,
        '{"name": "get_time", "parameters": {}} and that is all',
        "and that is all",
        [("get_time", "{}")],
        id="llama3 text after a call",
    ),
    pytest.param(
        LLAMA3_JSON,
        '{"name": "get_date", "parameters": {}}',
        '{"name": "get_date", "parameters": {}}',
        [],
        id="llama3 unknown tool: text",
    ),
    pytest.param(LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', [], id="llama3 other JSON: text"),
    pytest.param(
        LLAMA3_JSON,
        'Sure: {"name": "get_time", "parameters": {}}',
        'Sure: {"name": "get_time", "parameters": {}}',
        [],
        id="llama3 a call after text is text",
    ),
    pytest.param(LLAMA3_JSON, '{"name": "get_ti', '{"name": "get_ti', [], id="llama3 cut short"),
    pytest.param(
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "}]\\"{[ x"}}',
        "",
        [("get_weather", '{"city": "}]\\"{[ x"}')],
        id="llama3 brackets and quotes inside a string",
    ),
    pytest.param(LLAMA3_JSON, '{"name": "x"}} {', '{"name": "x"}} {', [], id="llama3 closed, not a call"),
    pytest.param(LLAMA3_JSON, "<|python", "<|python", [], id="llama3 half a tag"),
    pytest.param(LLAMA3_JSON, "  ", "  ", [], id="llama3 whitespace"),
    pytest.param(
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "",
        [("get_weather", '{"city": "Paris"}')],
        id="mistral one call",
    ),
    pytest.param(
        MISTRAL,
        'Let me check. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}, '
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}]  ',
        "Let me check.",
        [("get_time", "{}"), ("get_weather", '{"city": "Zürich"}')],
        id="mistral text then two calls",
    ),
    pytest.param(
        MISTRAL,
        '[TOOL_CALLS]{"name": "get_time", "arguments": {}}',
        "",
        [("get_time", "{}")],
        id="mistral one object, no list",
    ),
    pytest.param(
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        [],
        id="mistral one bad item: all text",
    ),
    pytest.param(
        MISTRAL,
        'A [TOOL_CALLS][{"name": "get_ti',
        'A [TOOL_CALLS][{"name": "get_ti',
        [],
        id="mistral cut short",
    ),
    pytest.param(MISTRAL, "[1, 2] [TOOL", "[1, 2] [TOOL", [], id="mistral half a marker at the end"),
    pytest.param(MISTRAL, "no calls", "no calls", [], id="mistral text"),
    pytest.param(
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "a]}\\\\"}}] done',
        "done",
        [("get_weather", '{"city": "a]}\\\\"}')],
        id="mistral brackets and an escaped backslash in a string",
    ),
    pytest.param(MISTRAL, "[TOOL_CALLS] [oops] then", "[TOOL_CALLS] [oops] then", [], id="mistral bad JSON"),
]


def streamed(fmt: ToolFormat, output: str, sizes: list[int]) -> tuple[str, list[ParsedCall]]:
    parser, pieces, at = make_parser(fmt, NAMES), [], 0
    for size in sizes:
        pieces += parser.feed(output[at : at + size])
        at += size
    pieces += parser.feed(output[at:]) + parser.close()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ParsedCall)]


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), OUTPUTS)
def test_parse_output(fmt: ToolFormat, output: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert parse_output(output, NAMES, fmt) == (content, [ParsedCall(n, a) for n, a in calls])


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), OUTPUTS)
def test_streamed_in_any_split_reads_the_same(
    fmt: ToolFormat, output: str, content: str, calls: list[tuple[str, str]]
) -> None:
    expected = parse_output(output, NAMES, fmt)
    assert streamed(fmt, output, [1] * len(output)) == expected
    rng = random.Random(len(output))
    for _ in range(30):
        assert streamed(fmt, output, [rng.randint(1, 9) for _ in range(len(output))]) == expected


def test_text_streams_at_once_and_calls_wait_to_be_whole() -> None:
    llama = make_parser(LLAMA3_JSON, NAMES)
    assert llama.feed("It is") == ["It is"]  # not a call: no holding back
    llama = make_parser(LLAMA3_JSON, NAMES)
    assert llama.feed('{"name": "get_time", ') == []
    assert llama.feed('"parameters": {}}') == [ParsedCall("get_time", "{}")]
    mistral = make_parser(MISTRAL, NAMES)
    assert mistral.feed("Sure [TOOL") == ["Sure"]
    assert mistral.feed('_CALLS][{"name": "get_time", "arguments": {}}') == []
    assert mistral.feed("]") == [ParsedCall("get_time", "{}")]


def test_a_would_be_call_that_never_ends_is_text() -> None:
    text = '{"name": "get_time", "parameters": {"x": "' + "a" * MAX_CALL_CHARS
    llama = make_parser(LLAMA3_JSON, NAMES)
    out = llama.feed(text[:10]) + llama.feed(text[10:] + "}")
    assert out == [text + "}"]


# --- ids, the forced call, the sampling parameters -----------------------------------------------------


def test_call_ids_as_each_template_wants_them() -> None:
    ids = {MISTRAL.call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    assert HERMES.call_id().startswith("call_") and len(HERMES.call_id()) > 20
    mapped = MISTRAL.template_id("call_abcdef0123456789")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == MISTRAL.template_id("call_abcdef0123456789")
    assert mapped != MISTRAL.template_id("call_abcdef0123456780")
    assert MISTRAL.template_id("Ab3dE6gH9") == "Ab3dE6gH9"  # already a valid id: kept
    assert HERMES.template_id("call_1") == "call_1"


@pytest.mark.parametrize(
    ("fmt", "choice", "parallel", "keys"),
    [
        pytest.param(HERMES, "required", True, ("", "<tool_call>\n", "\n", ""), id="hermes"),
        pytest.param(LLAMA3_JSON, "required", False, ("", "", "; ", ""), id="llama3: one call per turn"),
        pytest.param(MISTRAL, "required", True, ("[TOOL_CALLS][", "", ",", "]"), id="mistral"),
    ],
)
def test_the_forced_call_is_in_the_models_syntax(
    fmt: ToolFormat, choice: str, parallel: bool, keys: tuple[str, str, str, str]
) -> None:
    request = parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice}, True)
    assert request is not None
    params = tool_params(SamplingParams(), request, fmt)
    guide = Guide.from_json(params.guide)
    value = guide.value
    assert (value["prefix"], value["begin"], value["separator"], value["suffix"]) == keys
    assert value["args_key"] == fmt.args_key and value["parallel"] is parallel
    assert params.skip_special_tokens is not fmt.keep_special


def test_special_tokens_are_kept_only_where_a_marker_is_one() -> None:
    auto = parse_tools({"tools": [WEATHER]}, True)
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"}, True)
    assert tool_params(SamplingParams(), auto, MISTRAL).skip_special_tokens is False
    assert tool_params(SamplingParams(), none, MISTRAL).skip_special_tokens is True  # nothing read back
    assert tool_params(SamplingParams(), auto, LLAMA3_JSON).skip_special_tokens is True
    assert tool_params(SamplingParams(), auto, MISTRAL).guide == ""  # auto: the model is free


# --- the conversation as the family's template renders it ------------------------------------------------

CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abcdef0123456789",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abcdef0123456789", "content": "18C"},
]


@pytest.mark.parametrize("family", ["mistral", "llama3"])
def test_a_family_template_renders_tools_as_transformers_does(
    family: str, zoo: ZooPaths, tmp_path: Path
) -> None:
    model = family_model(zoo.base("tiny"), tmp_path / family, family)
    tok = load_tokenizer(model)
    body = {"messages": CONVERSATION, "tools": [WEATHER]}
    messages, shown = prompt_messages(chat_messages(body), parse_tools(body, True), tok.tool_format)
    ours = tok.render_chat(messages, tools=shown)
    hf_messages = json.loads(json.dumps(CONVERSATION))
    fmt = tok.tool_format
    assert fmt is not None
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    hf_messages[1]["tool_calls"][0]["id"] = hf_messages[2]["tool_call_id"] = fmt.template_id(
        "call_abcdef0123456789"
    )
    hf = AutoTokenizer.from_pretrained(str(model))
    expected = hf.apply_chat_template(
        hf_messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert ours == expected
    marker = "[TOOL_CALLS]" if family == "mistral" else "<|python_tag|>"
    assert tok.encode(marker) == [hf.convert_tokens_to_ids(marker)]  # one special token
