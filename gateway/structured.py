"""Structured-output requests: what a client asked the output to be, as one `loragate.guides.Guide`.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `schema`, `name`, `strict`) and
vLLM's extensions as `extra_body` sends them, top-level: `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, and the newer `structured_outputs: {json | regex | choice | grammar | json_object}`.
At most one constraint per request (two would have to agree, and nothing checks that they do): a second
is refused with 400 naming it. Only cheap checks happen here (types, a schema is an object); the grammar
engine lives in the worker (the gateway never imports it), which refuses a guide it cannot compile — a
regex outside its dialect, a grammar that does not parse — with an error event the gateway answers 400.
`json_schema` is always enforced, whatever `strict` says (stricter than asked never hurts a client).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import bad_request
from loragate.guides import ANY_JSON_OBJECT, Guide, GuideKind

# vLLM's top-level guided_* parameters and the keys of its `structured_outputs` object.
_VLLM_KINDS = {
    "json": GuideKind.JSON_SCHEMA,
    "regex": GuideKind.REGEX,
    "choice": GuideKind.CHOICE,
    "grammar": GuideKind.GRAMMAR,
}


def request_guide(body: dict[str, Any]) -> tuple[str, Guide] | None:
    """The request's one structured-output constraint and the parameter that asked for it (None: none)."""
    found = [g for g in (_response_format(body), *_guided(body), *_structured_outputs(body)) if g]
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad_request(
            f"'{second}' cannot be combined with '{first}': give one structured-output constraint.",
            param=second,
        )
    return found[0] if found else None


def _response_format(body: dict[str, Any]) -> tuple[str, Guide] | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'.", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", Guide(GuideKind.JSON_SCHEMA, ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise bad_request(
            f"'response_format' {kind!r} is not supported by this server.", param="response_format"
        )
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"'{where}' must be an object with a 'schema'.", param=where)
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise bad_request(f"'{where}.name' must be a string.", param=f"{where}.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request(f"'{where}.strict' must be a boolean.", param=f"{where}.strict")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        schema = ANY_JSON_OBJECT
    return "response_format", Guide(GuideKind.JSON_SCHEMA, json_schema(schema, f"{where}.schema"))


def _guided(body: dict[str, Any]) -> list[tuple[str, Guide] | None]:
    return [_vllm_guide(body.get(f"guided_{key}"), key, f"guided_{key}") for key in _VLLM_KINDS]


def _structured_outputs(body: dict[str, Any]) -> list[tuple[str, Guide] | None]:
    so = body.get("structured_outputs")
    if so is None:
        return []
    if not isinstance(so, dict):
        raise bad_request("'structured_outputs' must be an object.", param="structured_outputs")
    for key, value in so.items():
        if key not in (*_VLLM_KINDS, "json_object") and value is not None:
            where = f"structured_outputs.{key}"
            raise bad_request(f"'{where}' is not supported by this server.", param=where)
    found = [_vllm_guide(so.get(key), key, f"structured_outputs.{key}") for key in _VLLM_KINDS]
    json_object = so.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        where = "structured_outputs.json_object"
        raise bad_request(f"'{where}' must be a boolean.", param=where)
    if json_object:
        found.append(("structured_outputs.json_object", Guide(GuideKind.JSON_SCHEMA, ANY_JSON_OBJECT)))
    return found


def _vllm_guide(value: Any, key: str, param: str) -> tuple[str, Guide] | None:
    if value is None:
        return None
    kind = _VLLM_KINDS[key]
    if kind is GuideKind.JSON_SCHEMA:
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}' must be a JSON Schema (an object).", param=param) from None
        return param, Guide(kind, json_schema(value, param))
    if kind is GuideKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"'{param}' must be a non-empty list of strings.", param=param)
        return param, Guide(kind, list(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string.", param=param)
    return param, Guide(kind, value)


def json_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON Schema as a guide takes it: an object (the worker's engine checks the rest)."""
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON Schema (an object).", param=param)
    return schema
