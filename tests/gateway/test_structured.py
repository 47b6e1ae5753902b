"""Structured-output requests become exactly one guide, in the contract's shape; anything malformed or a
second constraint is a 400 naming its parameter; nulls and `text` ask for nothing."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import APIError
from gateway.structured import request_guide
from loragate.guides import ANY_JSON_OBJECT, Guide, GuideKind

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# (body, the parameter named, the guide)
GUIDES = [
    pytest.param(
        {"response_format": {"type": "json_object"}}, "response_format", ("json_schema", ANY_JSON_OBJECT)
    ),
    pytest.param(
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
            }
        },
        "response_format",
        ("json_schema", SCHEMA),
        id="json_schema strict",
    ),
    pytest.param(
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": None},
            }
        },
        "response_format",
        ("json_schema", SCHEMA),
        id="json_schema strict null",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        ("json_schema", ANY_JSON_OBJECT),
        id="json_schema without a schema: any object",
    ),
    pytest.param({"guided_json": SCHEMA}, "guided_json", ("json_schema", SCHEMA), id="guided_json"),
    pytest.param(
        {"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'},
        "guided_json",
        ("json_schema", SCHEMA),
        id="guided_json as text",
    ),
    pytest.param({"guided_regex": r"\d{3}"}, "guided_regex", ("regex", r"\d{3}"), id="guided_regex"),
    pytest.param(
        {"guided_choice": ["yes", "no"]}, "guided_choice", ("choice", ["yes", "no"]), id="guided_choice"
    ),
    pytest.param(
        {"guided_grammar": 'root ::= "a"'}, "guided_grammar", ("grammar", 'root ::= "a"'), id="grammar"
    ),
    pytest.param(
        {"structured_outputs": {"json": SCHEMA}},
        "structured_outputs.json",
        ("json_schema", SCHEMA),
        id="so json",
    ),
    pytest.param(
        {"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", ("regex", "a+"), id="so regex"
    ),
    pytest.param(
        {"structured_outputs": {"choice": ["x"], "regex": None}},
        "structured_outputs.choice",
        ("choice", ["x"]),
        id="so choice with a null",
    ),
    pytest.param(
        {"structured_outputs": {"grammar": "root ::= [a-z]+"}},
        "structured_outputs.grammar",
        ("grammar", "root ::= [a-z]+"),
        id="so grammar",
    ),
    pytest.param(
        {"structured_outputs": {"json_object": True}},
        "structured_outputs.json_object",
        ("json_schema", ANY_JSON_OBJECT),
        id="so json_object",
    ),
]


@pytest.mark.parametrize(("body", "param", "guide"), GUIDES)
def test_request_guide(body: dict[str, Any], param: str, guide: tuple[str, Any]) -> None:
    found = request_guide(body)
    assert found == (param, Guide(GuideKind(guide[0]), guide[1]))
    assert Guide.from_json(found[1].to_json()) == found[1]  # it crosses to the worker intact


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="nothing"),
        pytest.param({"response_format": {"type": "text"}}, id="text"),
        pytest.param({"response_format": None, "guided_json": None, "guided_choice": None}, id="nulls"),
        pytest.param({"structured_outputs": {"json_object": False}}, id="json_object false"),
        pytest.param({"structured_outputs": {}}, id="empty structured_outputs"),
    ],
)
def test_no_guide(body: dict[str, Any]) -> None:
    assert request_guide(body) is None


ERRORS = [
    pytest.param(
        {"response_format": "json"}, "response_format", "object with a 'type'", id="format a string"
    ),
    pytest.param(
        {"response_format": {}}, "response_format", "object with a 'type'", id="format without type"
    ),
    pytest.param({"response_format": {"type": "xml"}}, "response_format", "'xml' is not supported", id="xml"),
    pytest.param(
        {"response_format": {"type": "structural_tag"}},
        "response_format",
        "not supported",
        id="structural_tag",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "object with a 'schema'",
        id="json_schema missing",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
        "response_format.json_schema.schema",
        "JSON Schema",
        id="schema a list",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": True}}},
        "response_format.json_schema.schema",
        "JSON Schema",
        id="schema a boolean",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
        "response_format.json_schema.strict",
        "boolean",
        id="strict a string",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}},
        "response_format.json_schema.name",
        "string",
        id="name a number",
    ),
    pytest.param({"guided_json": "{not json"}, "guided_json", "JSON Schema", id="guided_json bad text"),
    pytest.param({"guided_json": 5}, "guided_json", "JSON Schema", id="guided_json a number"),
    pytest.param({"guided_regex": ""}, "guided_regex", "non-empty string", id="empty regex"),
    pytest.param({"guided_regex": ["a"]}, "guided_regex", "non-empty string", id="regex a list"),
    pytest.param({"guided_grammar": 1}, "guided_grammar", "non-empty string", id="grammar a number"),
    pytest.param({"guided_choice": []}, "guided_choice", "non-empty list", id="no choices"),
    pytest.param({"guided_choice": "a"}, "guided_choice", "non-empty list", id="choice a string"),
    pytest.param({"guided_choice": ["a", 1]}, "guided_choice", "non-empty list", id="a choice not a string"),
    pytest.param({"structured_outputs": "json"}, "structured_outputs", "object", id="so a string"),
    pytest.param(
        {"structured_outputs": {"structural_tag": "x"}},
        "structured_outputs.structural_tag",
        "not supported",
        id="so structural_tag",
    ),
    pytest.param(
        {"structured_outputs": {"json_object": "yes"}},
        "structured_outputs.json_object",
        "boolean",
        id="so jo",
    ),
    pytest.param(
        {"response_format": {"type": "json_object"}, "guided_regex": "a"},
        "guided_regex",
        "cannot be combined with 'response_format'",
        id="two constraints",
    ),
    pytest.param(
        {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
        "structured_outputs.regex",
        "cannot be combined with 'guided_choice'",
        id="guided and structured_outputs",
    ),
    pytest.param(
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs.choice",
        "cannot be combined",
        id="two keys of structured_outputs",
    ),
]


@pytest.mark.parametrize(("body", "param", "words"), ERRORS)
def test_request_guide_refuses(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as e:
        request_guide(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert words in e.value.message, e.value.message
