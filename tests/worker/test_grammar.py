"""Structured outputs in the engine: every guide kind decodes only strings of its language on the tiny zoo
model (random weights, sampled at temperature 1 so it explores), one mixed batch serves different guides,
unguided requests and LoRA adapters side by side, a finished grammar ends the request without a wasted
EOS step, resumed tokens are replayed into the matcher, and a bad guide fails in `add_request`."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest
import redis

from loragate.guides import Guide, GuideKind
from loragate.types import FinishReason, Request, SamplingParams
from tests.worker.test_service import start
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.engine_types import Completion
from worker.grammar import pack_bits
from worker.grammar_compile import choice_ebnf, ebnf_literal
from worker.modelzoo.make import ZooPaths

PROFILE = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "nick": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["color", "age", "admin", "nick", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"enum": ["A-1", "B-2"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "lines", "paid"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Lisbon", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
    "required": ["hour", "loud"],
    "additionalProperties": False,
}


def tools(parallel: bool) -> Guide:
    calls = [{"name": "get_weather", "parameters": WEATHER}, {"name": "set_alarm", "parameters": ALARM}]
    value = {"begin": "<tool_call>", "end": "</tool_call>", "calls": calls, "parallel": parallel}
    return Guide(GuideKind.TOOL_CALLS, value)


CHOICES = ['say "hi"', "a\\b", "line\nbreak", "é😀", "no"]
# Whole-output languages, each with an independent Python check. Each ends forced (once the output is
# complete, nothing but EOS may follow) but parallel tool calls, where another call may follow.
GUIDES: dict[str, Guide] = {
    "json-profile": Guide(GuideKind.JSON_SCHEMA, PROFILE),
    "json-order": Guide(GuideKind.JSON_SCHEMA, ORDER),
    "regex": Guide(GuideKind.REGEX, r"[a-c]{2,5}-\d"),
    "choice": Guide(GuideKind.CHOICE, CHOICES),
    "grammar": Guide(GuideKind.GRAMMAR, 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]?'),
    "tools": tools(parallel=False),
    "tools-parallel": tools(parallel=True),
}
GRAMMAR_AS_REGEX = r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)"


def tool_calls_in(guide: Guide, text: str) -> list[dict[str, Any]]:
    """The calls in `text`, each checked against its function's schema (raises if any is not valid)."""
    begin, end = guide.value["begin"], guide.value["end"]
    assert text.startswith(begin) and text.endswith(end), text
    calls = [json.loads(part) for part in text[len(begin) : -len(end)].split(end + "\n" + begin)]
    schemas = {c["name"]: c["parameters"] for c in guide.value["calls"]}
    for call in calls:
        assert set(call) == {"name", "arguments"}, call
        jsonschema.validate(call["arguments"], schemas[call["name"]])
    return calls


def assert_valid(guide: Guide, text: str) -> None:
    match guide.kind:
        case GuideKind.JSON_SCHEMA:
            jsonschema.validate(json.loads(text), guide.value)
        case GuideKind.REGEX:
            assert re.fullmatch(guide.value, text), text
        case GuideKind.CHOICE:
            assert text in guide.value, text
        case GuideKind.GRAMMAR:
            assert re.fullmatch(GRAMMAR_AS_REGEX, text), text
        case GuideKind.TOOL_CALLS:
            calls = tool_calls_in(guide, text)
            assert guide.value["parallel"] or len(calls) == 1, text


@pytest.fixture(scope="module")
def engine(zoo: ZooPaths) -> LLMEngine:
    adapters = {n: zoo.adapter("tiny", n) for n in zoo.adapter_names("tiny")}
    return LLMEngine(zoo.base("tiny"), EngineConfig(adapters=adapters, num_kv_blocks=512))


def guided(rid: str, guide: Guide | None, seed: int, adapter: str | None = None, **kw: Any) -> Request:
    params = SamplingParams(
        max_tokens=kw.pop("max_tokens", 160),
        temperature=1.0,
        seed=seed,
        guide=guide.to_json() if guide is not None else "",
        **kw,
    )
    return Request(rid, tuple(range(20 + seed, 44 + seed)), params, adapter)


def eos(engine: LLMEngine) -> set[int]:
    return set(engine.model_config.eos_token_ids)


@pytest.mark.parametrize("name", list(GUIDES))
def test_each_guide_kind_decodes_only_valid_output(engine: LLMEngine, name: str) -> None:
    guide = GUIDES[name]
    done = engine.generate([guided(f"{name}-{s}", guide, s) for s in range(4)])
    for c in done:
        assert c.finish_reason is FinishReason.STOP, (c.text, c.finish_reason)
        assert_valid(guide, c.text)
        # A forced end finishes the request on its last token, without an EOS step.
        assert not eos(engine) & set(c.token_ids[:-1]), c.token_ids
        assert (c.token_ids[-1] in eos(engine)) == (name == "tools-parallel"), c.token_ids
    assert len({c.text for c in done}) > 1, "the model explores: seeds give different outputs"


def test_parallel_tool_calls_may_repeat_and_single_ones_do_not(engine: LLMEngine) -> None:
    counts = {
        parallel: [
            len(tool_calls_in(tools(parallel), c.text))
            for c in engine.generate([guided(f"p{parallel}{s}", tools(parallel), s) for s in range(10)])
        ]
        for parallel in (False, True)
    }
    assert counts[False] == [1] * 10
    assert max(counts[True]) > 1, counts


def test_a_complete_grammar_that_may_go_on_leaves_the_end_to_eos(engine: LLMEngine) -> None:
    guide = Guide(GuideKind.CHOICE, ["1", "12", "123"])
    done = engine.generate([guided(f"pre{s}", guide, s) for s in range(12)])
    for c in done:
        assert c.finish_reason is FinishReason.STOP and c.text in guide.value
        # "123" is forced to end there; "1" and "12" end only when the model picks EOS.
        assert (c.token_ids[-1] in eos(engine)) == (c.text != "123"), (c.text, c.token_ids)
    assert {c.text for c in done} >= {"123", "1"} or {c.text for c in done} >= {"123", "12"}


def test_one_mixed_batch_serves_each_request_its_own_guide(engine: LLMEngine) -> None:
    names = list(GUIDES)
    adapters: list[str | None] = [None, *engine.adapters.paths]
    requests: list[Request] = []
    for i in range(2 * len(names)):
        name = names[i % len(names)]
        adapter = adapters[i % len(adapters)]
        requests.append(guided(f"mix-{name}-{i}", GUIDES[name], i, adapter, max_tokens=400))
    free = [
        guided(f"free-{i}", None, 100 + i, adapters[-1 - i], max_tokens=24, ignore_eos=True) for i in range(4)
    ]
    steps = engine.grammar.stats.mask_steps
    done = {c.request_id: c for c in engine.generate(requests + free)}
    assert len({r.adapter for r in requests + free}) >= 8, "base and many adapters in the same steps"
    for r in requests:
        assert done[r.request_id].finish_reason is FinishReason.STOP
        assert_valid(Guide.from_json(r.params.guide), done[r.request_id].text)
    # The unguided rows are untouched by their guided neighbours: the same tokens as when run alone.
    alone: dict[str, Completion] = {}
    for r in free:
        alone[r.request_id] = engine.generate([r])[0]
    for r in free:
        assert done[r.request_id].token_ids == alone[r.request_id].token_ids
        assert len(alone[r.request_id].token_ids) == 24
    assert engine.grammar.stats.mask_steps > steps


def test_unguided_steps_never_touch_the_grammar(engine: LLMEngine) -> None:
    before = engine.grammar.stats.mask_steps
    engine.generate([guided(f"plain{s}", None, s, max_tokens=8) for s in range(3)])
    assert engine.grammar.stats.mask_steps == before


def test_resumed_tokens_are_replayed_into_the_matcher(engine: LLMEngine) -> None:
    guide = GUIDES["json-order"]
    first = engine.generate([guided("whole", guide, 7)])[0]
    head = tuple(first.token_ids[:9])
    resumed = guided("resumed", guide, 8)
    resumed = Request(resumed.request_id, resumed.prompt_token_ids, resumed.params, resume_token_ids=head)
    rest = engine.generate([resumed])[0]  # its new tokens only
    # Valid only if the matcher went on from the resumed tokens (starting afresh would open a second "{").
    assert_valid(guide, engine.tokenizer.decode([*head, *rest.token_ids]))
    off_guide = engine.tokenizer.encode("[1,2]", add_special_tokens=False).ids
    broken = Request("broken", resumed.prompt_token_ids, resumed.params, resume_token_ids=tuple(off_guide))
    with pytest.raises(ValueError, match="do not follow"):
        engine.add_request(broken)
    assert not engine.has_work()


def calls(*functions: dict[str, Any]) -> Guide:
    return Guide(GuideKind.TOOL_CALLS, {"begin": "", "end": "", "calls": list(functions)})


JSON, REGEX, GRAMMAR, CHOICE = GuideKind.JSON_SCHEMA, GuideKind.REGEX, GuideKind.GRAMMAR, GuideKind.CHOICE
BAD: list[tuple[str, str, dict[str, Any]]] = [
    ("not-a-guide", "not a structured-output guide", {"guide": "{}"}),
    ("unknown-kind", "not a structured-output guide", {"guide": '{"type":"cfg","value":"x"}'}),
    ("schema-type", "invalid json_schema guide: Unsupported type", {"guide": Guide(JSON, {"type": "no"})}),
    ("schema-not-object", "JSON Schema object", {"guide": Guide(JSON, [1, 2])}),
    ("schema-ref", "invalid json_schema guide", {"guide": Guide(JSON, {"$ref": "#/nowhere"})}),
    ("regex", "invalid regex guide: Regex parsing error", {"guide": Guide(REGEX, "(ab")}),
    ("regex-not-string", "regex guide must be a string", {"guide": Guide(REGEX, 3)}),
    ("grammar-no-root", "invalid grammar guide: .*root", {"guide": Guide(GRAMMAR, 'start ::= "a"')}),
    ("grammar-syntax", "invalid grammar guide", {"guide": Guide(GRAMMAR, "root ::= x")}),
    ("choice-empty", "non-empty list of strings", {"guide": Guide(CHOICE, [])}),
    ("choice-not-strings", "non-empty list of strings", {"guide": Guide(CHOICE, ["a", 1])}),
    ("tools-no-calls", "non-empty list of calls", {"guide": calls()}),
    (
        "tools-bad-schema",
        "invalid tool_calls guide",
        {"guide": calls({"name": "f", "parameters": {"type": 5}})},
    ),
    ("tools-no-name", "tool call name", {"guide": calls({"parameters": {}})}),
    ("ignore-eos", "ignore_eos", {"guide": GUIDES["regex"], "ignore_eos": True}),
]


@pytest.mark.parametrize(("message", "kw"), [(m, kw) for _, m, kw in BAD], ids=[i for i, _, _ in BAD])
def test_bad_guides_fail_in_add_request(engine: LLMEngine, message: str, kw: dict[str, Any]) -> None:
    kw = dict(kw)
    guide = kw.pop("guide")
    raw = guide.to_json() if isinstance(guide, Guide) else guide
    request = Request("bad", (5, 6, 7), SamplingParams(guide=raw, **kw))
    with pytest.raises(ValueError, match=message):
        engine.add_request(request)
    assert not engine.has_work()


def test_ebnf_literals_escape_what_the_grammar_would_read() -> None:
    assert ebnf_literal('a"b\\c\nd\x7fé') == '"a\\"b\\\\c\\u000ad\\u007fé"'
    assert choice_ebnf(["x", ""]) == 'root ::= "x" | ""'


def test_pack_bits_sets_token_bits_word_by_word() -> None:
    import torch

    bits = torch.zeros(64, dtype=torch.bool)
    bits[[0, 31, 33]] = True
    assert pack_bits(bits).tolist() == [1 - 2**31, 2]


# Per keyword xgrammar does not enforce: a schema using it, and a document that breaks it.
UNENFORCED_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "not": ({"not": {"type": "integer"}}, "3"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a":1}',
    ),
    "dependentSchemas": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        '{"a":1}',
    ),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
}


@pytest.mark.parametrize("keyword", list(UNENFORCED_CASES))
def test_schemas_with_keywords_xgrammar_ignores_are_refused(engine: LLMEngine, keyword: str) -> None:
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    schema, breaking = UNENFORCED_CASES[keyword]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema)
    # Why it is refused: xgrammar's grammar for it lets the breaking document through.
    assert _is_grammar_accept_string(Grammar.from_json_schema(json.dumps(schema)), breaking)
    nested = {"type": "object", "properties": {"x": {"anyOf": [schema]}}}
    for s in (schema, nested):
        with pytest.raises(ValueError, match=f"uses {keyword}, which the grammar engine cannot enforce"):
            engine.add_request(Request("unenforced", (5, 6), SamplingParams(guide=Guide(JSON, s).to_json())))
    assert not engine.has_work()


def test_keywords_are_told_from_property_names_and_values(engine: LLMEngine) -> None:
    schema = {
        "type": "object",
        "properties": {"not": {"enum": [{"uniqueItems": True}]}, "allOf": {"const": "x"}},
        "required": ["not", "allOf"],
    }
    [done] = engine.generate([guided("names", Guide(JSON, schema), 1)])
    assert json.loads(done.text) == {"not": {"uniqueItems": True}, "allOf": "x"}


def test_a_guided_request_reports_the_models_own_logprobs_not_the_masked_ones(engine: LLMEngine) -> None:
    """The grammar shapes what is sampled, not what is reported: the first token's top log-probabilities of a
    guided request equal those of the same prompt unguided (raw log-softmax), though the mask forbids most
    of those tokens, and the sampled token is one the guide allows."""
    prompt = tuple(range(11, 30))
    guide = Guide(GuideKind.CHOICE, ["yes", "no"])
    outputs: dict[str, Any] = {}
    for name, g in (("free", ""), ("forced", guide.to_json())):
        engine.add_request(Request(f"lp2-{name}", prompt, SamplingParams(max_tokens=1, logprobs=5, guide=g)))
    while engine.has_work():
        for out in engine.step():
            if out.logprobs:
                outputs[out.request_id] = out.logprobs[0]
    free_lp, forced_lp = outputs["lp2-free"], outputs["lp2-forced"]
    assert [t for t, _ in forced_lp.top] == [t for t, _ in free_lp.top]
    assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(forced_lp.top, free_lp.top, strict=True))
    allowed = {engine.tokenizer.encode(w, add_special_tokens=False).ids[0] for w in ("yes", "no")}
    assert forced_lp.token_id in allowed and len({t for t, _ in free_lp.top} - allowed) >= 3


def test_a_worker_loads_the_grammar_engine_in_the_background_before_any_guided_request(
    zoo: ZooPaths, redis_url: str
) -> None:
    # Loaded on the step thread by the first guided request, it would stall every running request ~1.4 s.
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        with start(zoo, r) as service:
            deadline = time.monotonic() + 60
            while not service.engine.grammar.is_warm and time.monotonic() < deadline:
                time.sleep(0.05)
            assert service.engine.grammar.is_warm
            assert service.engine.snapshot().steps == 0  # no request did it
    finally:
        r.close()
