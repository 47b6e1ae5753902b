"""Tools: the request's tools and tool choice (400 naming what is wrong), the forcing guide, the prompt
(the default format for the zoo's and SmolLM2's templates, which know no tools; `tools=` for a template
that does, as transformers renders it), and the output read back — whole or streamed in any split, the
same calls and content."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.chat_input import chat_messages
from gateway.errors import APIError
from gateway.tokenize import load_tokenizer
from gateway.tool_calls import ParsedCall, ToolCallParser
from gateway.tool_calls_json import parse_output
from gateway.tool_formats import HERMES
from gateway.tools import ToolRequest, parse_tools, prompt_messages
from loragate.guides import Guide, GuideKind
from worker.modelzoo.make import ZooPaths

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NO_PARAMETERS = {"type": "object", "properties": {}}


def tools_of(body: dict[str, Any], chat: bool = True) -> ToolRequest | None:
    return parse_tools(body, chat)


# --- the request ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "choice", "named", "parallel"),
    [
        pytest.param({"tools": [WEATHER]}, "auto", None, True, id="default: auto, parallel"),
        pytest.param({"tools": [WEATHER], "tool_choice": "none"}, "none", None, True, id="none"),
        pytest.param({"tools": [WEATHER], "tool_choice": "required"}, "required", None, True, id="required"),
        pytest.param(
            {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "named",
            "get_time",
            True,
            id="named",
        ),
        pytest.param(
            {"tools": [WEATHER], "parallel_tool_calls": False}, "auto", None, False, id="not parallel"
        ),
        pytest.param({"tools": [WEATHER], "tool_choice": None}, "auto", None, True, id="null choice"),
    ],
)
def test_parse_tools(body: dict[str, Any], choice: str, named: str | None, parallel: bool) -> None:
    request = tools_of(body)
    assert request is not None
    assert (request.choice, request.named, request.parallel) == (choice, named, parallel)
    assert request.parsed is (choice != "none")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="nothing"),
        pytest.param({"tools": None, "tool_choice": None, "parallel_tool_calls": None}, id="nulls"),
        pytest.param({"tools": [], "tool_choice": "auto"}, id="no tools, auto"),
        pytest.param({"tool_choice": "none"}, id="no tools, none"),
    ],
)
def test_no_tools(body: dict[str, Any]) -> None:
    assert tools_of(body) is None


def test_a_tool_without_parameters_takes_an_empty_object() -> None:
    request = tools_of({"tools": [TIME]})
    assert request is not None and request.tools[0].parameters == NO_PARAMETERS


TOOL_ERRORS = [
    pytest.param({"tools": [WEATHER]}, False, "tools", "/v1/chat/completions", id="on completions"),
    pytest.param({"tools": {"a": 1}}, True, "tools", "list", id="tools an object"),
    pytest.param({"tools": [{"type": "code"}]}, True, "tools[0]", "'type': 'function'", id="not a function"),
    pytest.param({"tools": [{"type": "function"}]}, True, "tools[0]", "'type': 'function'", id="no function"),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        True,
        "tools[0].function.name",
        "1-64 letters",
        id="bad name",
    ),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
        True,
        "tools[0].function.name",
        "1-64",
        id="long name",
    ),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        True,
        "tools[0].function.parameters",
        "JSON Schema",
        id="parameters a list",
    ),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
        True,
        "tools[0].function.description",
        "string",
        id="description a number",
    ),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "y"}}]},
        True,
        "tools[0].function.strict",
        "boolean",
        id="strict a string",
    ),
    pytest.param({"tools": [TIME, TIME]}, True, "tools", "unique", id="duplicate names"),
    pytest.param({"tool_choice": "required"}, True, "tool_choice", "needs 'tools'", id="required, no tools"),
    pytest.param(
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        True,
        "tool_choice",
        "needs 'tools'",
        id="named, no tools",
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        True,
        "tool_choice",
        "'nope', which is not one of the tools",
        id="unknown name",
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": "always"}, True, "tool_choice", "must be", id="unknown mode"
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": {"type": "function"}},
        True,
        "tool_choice",
        "must be",
        id="no name",
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
        True,
        "tool_choice",
        "must be",
        id="a list for a name",
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": {"a": 1}}}},
        True,
        "tool_choice",
        "must be",
        id="an object for a name",
    ),
    pytest.param(
        {"tools": [WEATHER], "parallel_tool_calls": 1}, True, "parallel_tool_calls", "boolean", id="par"
    ),
]


@pytest.mark.parametrize(("body", "chat", "param", "words"), TOOL_ERRORS)
def test_parse_tools_refuses(body: dict[str, Any], chat: bool, param: str, words: str) -> None:
    with pytest.raises(APIError) as e:
        tools_of(body, chat)
    assert (e.value.status, e.value.param) == (400, param)
    assert words in e.value.message, e.value.message


# --- the guide that forces a call -------------------------------------------------------------------------

WEATHER_CALL = {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}  # type: ignore[index]
TIME_CALL = {"name": "get_time", "parameters": NO_PARAMETERS}


@pytest.mark.parametrize(
    ("body", "calls", "parallel"),
    [
        pytest.param({"tool_choice": "required"}, [WEATHER_CALL, TIME_CALL], True, id="required"),
        pytest.param(
            {"tool_choice": "required", "parallel_tool_calls": False},
            [WEATHER_CALL, TIME_CALL],
            False,
            id="one",
        ),
        pytest.param(
            {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            [TIME_CALL],
            False,
            id="named",
        ),
    ],
)
def test_forced_choices_guide_the_output(body: dict[str, Any], calls: list[Any], parallel: bool) -> None:
    request = tools_of({"tools": [WEATHER, TIME], **body})
    assert request is not None
    value = {
        "prefix": "",
        "begin": "<tool_call>\n",
        "end": "\n</tool_call>",
        "separator": "\n",
        "suffix": "",
        "args_key": "arguments",
        "calls": calls,
        "parallel": parallel,
    }
    assert request.guide() == Guide(GuideKind.TOOL_CALLS, value)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_free_choices_have_no_guide(choice: str) -> None:
    request = tools_of({"tools": [WEATHER], "tool_choice": choice})
    assert request is not None and request.guide() is None


# --- the prompt -------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
]

DEFAULT_FORMAT = """<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", \
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris and Rome?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Rome"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
sunny
</tool_response>
<tool_response>
rain
</tool_response><|im_end|>
<|im_start|>assistant
"""


@pytest.fixture(params=["tiny", "smollm2"])
def model_dir(request: pytest.FixtureRequest, zoo: ZooPaths) -> Path:
    if request.param == "tiny":
        return zoo.base("tiny")
    path: Path = request.getfixturevalue("smollm2")
    return path


def render(model: Path, body: dict[str, Any]) -> str:
    tok = load_tokenizer(model)
    messages, shown = prompt_messages(chat_messages(body), tools_of(body), tok.tool_format)
    return tok.render_chat(messages, tools=shown)


def test_templates_without_tools_get_the_default_format(model_dir: Path) -> None:
    assert load_tokenizer(model_dir).tool_format is None
    assert render(model_dir, {"messages": CONVERSATION, "tools": [WEATHER]}) == DEFAULT_FORMAT


def test_the_tools_block_joins_the_callers_system_message(zoo: ZooPaths) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]], "tools": [TIME]}
    text = render(zoo.base("tiny"), body)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"' in text
    assert text.count("<|im_start|>system") == 1


def test_without_tools_the_prompt_is_the_templates_own(zoo: ZooPaths) -> None:
    tok = load_tokenizer(zoo.base("tiny"))
    messages = [{"role": "user", "content": "hi"}]
    assert render(zoo.base("tiny"), {"messages": messages}) == tok.render_chat(messages)


TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for c in message.tool_calls or [] %}<tool_call>{{ c.function.name }}|\
{{- c.function.arguments.city }}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_knows_tools_renders_them_as_transformers_does(zoo: ZooPaths, tmp_path: Path) -> None:
    model = tmp_path / "tool-model"
    shutil.copytree(zoo.base("tiny"), model)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    assert load_tokenizer(model).tool_format == HERMES
    ours = render(model, {"messages": CONVERSATION, "tools": [WEATHER]})
    hf_messages = json.loads(json.dumps(CONVERSATION))
    for call in hf_messages[1]["tool_calls"]:  # transformers' convention: arguments as a mapping
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    hf = AutoTokenizer.from_pretrained(str(model))
    expected = hf.apply_chat_template(
        hf_messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert ours == expected
    assert "<tool_call>get_weather|Paris</tool_call><tool_call>get_weather|Rome</tool_call>" in ours


# --- the output read back ---------------------------------------------------------------------------------

NAMES = frozenset({"get_weather", "get_time"})


def call_block(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


PARIS = call_block("get_weather", {"city": "Paris"})
OUTPUTS = [
    pytest.param("Just text.", "Just text.", [], id="no call"),
    pytest.param(PARIS, "", [("get_weather", '{"city": "Paris"}')], id="one call"),
    pytest.param(
        f"{PARIS}\n{call_block('get_time', {})}",
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
        id="two calls",
    ),
    pytest.param(
        f"Let me look.\n{PARIS}\n", "Let me look.", [("get_weather", '{"city": "Paris"}')], id="text first"
    ),
    pytest.param(
        f"{PARIS}\nDone.",
        "Done.",
        [("get_weather", '{"city": "Paris"}')],
        id="text after, whitespace dropped",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        "",
        [("get_weather", '{"city": "Oslo"}')],
        id="unterminated block at the end",
    ),
    pytest.param(
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
        [],
        id="unknown tool stays text",
    ),
    pytest.param(
        'a <tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>',
        'a <tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>',
        [],
        id="bad JSON stays text",
    ),
    pytest.param(
        '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',
        [],
        id="arguments not an object",
    ),
    pytest.param(
        '<tool_call>["get_time"]</tool_call>', '<tool_call>["get_time"]</tool_call>', [], id="not an object"
    ),
    pytest.param(
        '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
        '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
        [],
        id="a list for a name stays text",
    ),
    pytest.param(
        '<tool_call>{"name": {"n": 1}, "arguments": {}}</tool_call>',
        '<tool_call>{"name": {"n": 1}, "arguments": {}}</tool_call>',
        [],
        id="an object for a name stays text",
    ),
    pytest.param('<tool_call>\n{"name": "get_ti', '<tool_call>\n{"name": "get_ti', [], id="cut short"),
    pytest.param("a < b <tool", "a < b <tool", [], id="a tag's start at the end stays text"),
    pytest.param("  spaced  ", "  spaced  ", [], id="whitespace without calls is kept"),
    pytest.param(
        '{"name": "get_time", "arguments": {}}',
        '{"name": "get_time", "arguments": {}}',
        [],
        id="no tags: text",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "<tool_call>"}}\n</tool_call>',
        "",
        [("get_weather", '{"city": "<tool_call>"}')],
        id="a tag inside the arguments",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
        "",
        [("get_weather", '{"city": "Zürich"}')],
        id="non-ASCII arguments kept as they are",
    ),
]


@pytest.mark.parametrize(("output", "content", "calls"), OUTPUTS)
def test_parse_output(output: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert parse_output(output, NAMES, HERMES) == (content, [ParsedCall(n, a) for n, a in calls])


def streamed(output: str, sizes: list[int]) -> tuple[str, list[ParsedCall]]:
    parser, pieces, at = ToolCallParser(NAMES), [], 0
    for size in sizes:
        pieces += parser.feed(output[at : at + size])
        at += size
    pieces += parser.feed(output[at:]) + parser.close()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ParsedCall)]


@pytest.mark.parametrize(("output", "content", "calls"), OUTPUTS)
def test_streamed_in_any_split_reads_the_same(
    output: str, content: str, calls: list[tuple[str, str]]
) -> None:
    expected = parse_output(output, NAMES, HERMES)
    assert streamed(output, [1] * len(output)) == expected  # character by character
    rng = random.Random(len(output))
    for _ in range(30):
        assert streamed(output, [rng.randint(1, 9) for _ in range(len(output))]) == expected


def test_the_parser_holds_back_only_what_may_become_a_call() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]  # the space and the tag's start wait
    assert parser.feed("box> and") == [" <toolbox> and"]
    assert parser.feed(" more") == [" more"]
    assert parser.feed("\n<tool_call>\n{") == []
    assert parser.feed('"name": "get_time", "arguments": {}}\n</tool_call>') == [ParsedCall("get_time", "{}")]
    assert parser.close() == []
