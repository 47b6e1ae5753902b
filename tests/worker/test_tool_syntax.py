"""Forced tool calls in each model family's syntax, through the real engine (tiny model, its tokenizer given
the family's marker as a special token): every output of a `tool_calls` guide the gateway builds for a
format reads back, with the gateway's parser of that format, as calls only — valid for their schemas —
whatever the seed; and special tokens reach the text only when a request keeps them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from gateway.tool_calls_json import parse_output
from gateway.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from gateway.tools import parse_tools, tool_params
from loragate.types import FinishReason, Request, SamplingParams
from tests.tool_models import family_model
from worker.config import EngineConfig
from worker.detokenizer import DetokenizerState, IncrementalDetokenizer
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Lisbon", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": CITY}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=["mistral", "llama3"])
def family(request: pytest.FixtureRequest, zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_model(zoo.base("tiny"), tmp_path_factory.mktemp("family") / request.param, request.param)


def forced(fmt: ToolFormat, choice: Any, parallel: bool, seed: int) -> SamplingParams:
    body = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    request = parse_tools(body, chat=True)
    return tool_params(SamplingParams(max_tokens=120, temperature=1.0, seed=seed), request, fmt)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_forced_calls_read_back_as_calls_in_each_syntax(family: Path, fmt: ToolFormat) -> None:
    engine = LLMEngine(family, EngineConfig(num_kv_blocks=256))
    requests = [
        # One call each: a random model, free to add calls, adds them until max_tokens (the parsers read
        # lists of calls in tests/gateway/test_tool_formats.py).
        Request(f"{fmt.name}-{choice}-{s}", tuple(range(30 + s, 50 + s)), forced(fmt, choice, False, s))
        for choice in ("required", {"type": "function", "function": {"name": "forecast"}})
        for s in range(4)
    ]
    done = engine.generate(requests)
    counts = []
    for c in done:
        assert c.finish_reason is not FinishReason.LENGTH, c.text
        content, calls = parse_output(c.text, frozenset(SCHEMAS), fmt)
        assert content == "" and calls, c.text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        counts.append(len(calls))
    assert set(counts) == {1}
    if fmt is MISTRAL:  # the marker is the special token when the model picks it, and in the text either way
        assert all(c.text.startswith("[TOOL_CALLS][") for c in done)


def test_special_tokens_reach_the_text_only_when_kept(family: Path) -> None:
    tok = Tokenizer.from_file(str(family / "tokenizer.json"))
    marker = "[TOOL_CALLS]" if "mistral" in family.name else "<|python_tag|>"
    ids = [tok.token_to_id(marker), *tok.encode('{"a": 1}', add_special_tokens=False).ids]
    detok = IncrementalDetokenizer(tok)
    texts = {}
    for skip in (True, False):
        state = DetokenizerState.start([5, 6, 7], (), skip_special=skip)
        for n in range(1, len(ids) + 1):
            detok.update(state, ids[:n])
        texts[skip] = state.text
    assert texts == {True: '{"a": 1}', False: marker + '{"a": 1}'}
