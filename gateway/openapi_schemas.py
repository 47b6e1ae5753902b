"""The schemas of the OpenAPI description (gateway/openapi.py): requests as the handlers accept them,
responses, and the OpenAI error object; with the small builders both modules use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    SEED_MAX,
    SEED_MIN,
)

INT32 = 2**31 - 1
NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(props: dict[str, Any], required: Iterable[str] = (), **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), **extra}


def json_response(schema: dict[str, Any], description: str = "OK", **extra: Any) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}, **extra}


def requestschemas(models: list[str]) -> dict[str, Any]:
    model = {"type": "string", "minLength": 1, "examples": models or ["tiny"]}
    common = {
        "model": model,
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": INT32},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": INT32, "description": "0 or -1: off."},
        "seed": {"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX},
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                    "maxItems": MAX_STOPS,
                    "description": "Duplicates count once.",
                },
                {"type": "null"},
            ]
        },
        "stream": {"type": "boolean"},
        "stream_options": {"anyOf": [obj({"include_usage": {"type": "boolean"}}), {"type": "null"}]},
        "n": {"enum": [1, None]},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "user": {"type": "string"},
        "ignore_eos": {"type": "boolean", "description": "Not OpenAI's: generate past the end token."},
        **sampling_extras(),
        **structured_outputs(),
    }
    chat_only = {
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "description": "Needs logprobs."},
        **tool_parameters(),
    }
    completion_only = {
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "echo": {
            "type": "boolean",
            "description": "The prompt first (with logprobs: its log-probabilities).",
        },
    }
    tokens = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    text_part = obj({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"])
    call = obj(
        {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": obj(
                {"name": {"type": "string"}, "arguments": {"type": "string"}}, ["name", "arguments"]
            ),
        },
        ["function"],
    )
    message = obj(
        {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
            "content": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": text_part}, {"type": "null"}]
            },
            "tool_calls": {
                "type": "array",
                "items": call,
                "description": "Assistant: then content may be null.",
            },
            "tool_call_id": {"type": "string"},
            "name": {"type": "string"},
        },
        ["role"],
        description="content is required, except on an assistant message with tool_calls.",
    )
    prompt = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            tokens,
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": tokens, "minItems": 1, "maxItems": 1},
        ]
    }
    usage = obj(
        {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        ["prompt_tokens", "completion_tokens", "total_tokens"],
    )
    choice = {"type": "object", "required": ["index", "finish_reason"]}
    return {
        "CompletionRequest": obj({**common, **completion_only, "prompt": prompt}, ["model", "prompt"]),
        "ChatCompletionRequest": obj(
            {
                **common,
                **chat_only,
                "messages": {"type": "array", "items": message, "minItems": 1},
                "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": INT32},
            },
            ["model", "messages"],
        ),
        "Completion": obj(
            {
                "id": {"type": "string"},
                "object": {"const": "text_completion"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": choice},
                "usage": usage,
            },
            ["id", "object", "model", "choices"],
        ),
        "ChatCompletion": obj(
            {
                "id": {"type": "string"},
                "object": {"const": "chat.completion"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": choice},
                "usage": usage,
            },
            ["id", "object", "model", "choices"],
        ),
    }


def sampling_extras() -> dict[str, Any]:
    """Sampling beyond OpenAI's basics (vLLM's names); token ids must also be below the vocabulary size."""
    token_id = {"type": "integer", "minimum": 0, "maximum": INT32}
    return {
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e9},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "min_tokens": {
            "type": "integer",
            "minimum": 0,
            "maximum": INT32,
            "description": "At most max_tokens.",
        },
        "logit_bias": {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "maxProperties": MAX_LOGIT_BIAS,
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        "stop_token_ids": {
            "type": "array",
            "items": token_id,
            "description": f"At most {MAX_STOP_TOKEN_IDS} distinct ids.",
        },
    }


def structured_outputs() -> dict[str, Any]:
    """`response_format` and vLLM's guided_* / structured_outputs: at most one of them per request."""
    schema = {"type": "object", "description": "A JSON Schema."}
    text = {"type": "string", "minLength": 1}
    choice = {"type": "array", "items": {"type": "string"}, "minItems": 1}
    json_schema = obj(
        {
            "name": {"type": "string"},
            "schema": schema,
            "strict": {"type": "boolean"},
            "description": {"type": "string"},
        }
    )
    fmt = {
        "anyOf": [
            obj({"type": {"enum": ["text", "json_object"]}}, ["type"]),
            obj({"type": {"const": "json_schema"}, "json_schema": json_schema}, ["type", "json_schema"]),
            {"type": "null"},
        ]
    }
    return {
        "response_format": fmt,
        "guided_json": {"anyOf": [schema, {"type": "string"}], "description": "vLLM's: a JSON Schema."},
        "guided_regex": {**text, "description": "vLLM's: the whole output matches it."},
        "guided_choice": {**choice, "description": "vLLM's: the output is one of them."},
        "guided_grammar": {**text, "description": "vLLM's: an EBNF grammar (xgrammar's dialect)."},
        "structured_outputs": obj(
            {
                "json": schema,
                "regex": text,
                "choice": choice,
                "grammar": text,
                "json_object": {"type": "boolean"},
            },
            description="vLLM's newer form of guided_*: one key.",
        ),
    }


def tool_parameters() -> dict[str, Any]:
    function = obj(
        {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "A JSON Schema."},
            "strict": {"type": "boolean"},
        },
        ["name"],
    )
    named = obj(
        {"type": {"const": "function"}, "function": obj({"name": {"type": "string"}}, ["name"])},
        ["type", "function"],
    )
    return {
        "tools": {
            "type": "array",
            "items": obj({"type": {"const": "function"}, "function": function}, ["type", "function"]),
        },
        "tool_choice": {
            "anyOf": [{"enum": ["none", "auto", "required"]}, named, {"type": "null"}],
            "description": "required or a named function needs tools (and the name among them).",
        },
        "parallel_tool_calls": {"type": "boolean"},
    }


def schemas(models: list[str]) -> dict[str, Any]:
    error = obj(
        {
            "error": obj(
                {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                ["message", "type", "param", "code"],
            )
        },
        ["error"],
    )
    adapter = obj(
        {
            "name": NAME,
            "base": NAME,
            "path": {"type": "string"},
            "tenants": {"type": "array"},
            "pinned": {"type": "boolean"},
        },
        ["name", "base", "path", "tenants", "pinned"],
    )
    return {
        "Error": error,
        **requestschemas(models),
        "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array"}}, ["object", "data"]),
        "Model": obj(
            {"id": {"type": "string"}, "object": {"const": "model"}, "owned_by": {"type": "string"}},
            ["id", "object", "owned_by"],
        ),
        "Health": obj(
            {
                "status": {"enum": ["ok", "unavailable"]},
                "workers": {"type": "integer"},
                "models": {"type": "array", "items": {"type": "string"}},
            },
            ["status", "workers", "models"],
        ),
        "Adapter": adapter,
        "AdapterRegistration": obj(
            {
                "path": {"type": "string", "minLength": 1},
                "tenants": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "pinned": {"type": "boolean"},
            },
            ["path"],
        ),
        "Pin": obj({"pinned": {"type": "boolean"}}),
        "KeyRequest": obj({"tenant": NAME}, ["tenant"]),
        "Key": obj(
            {"key": {"type": "string"}, "key_id": {"type": "string"}, "tenant": {"type": "string"}},
            ["key", "key_id", "tenant"],
        ),
        "PolicyDocument": {"type": "object", "description": "A routing policy (policies/document.py)."},
        "PolicyVersion": obj({"version": {"type": "integer"}}, ["version"]),
        "Rollback": obj({"version": {"type": "integer"}}, ["version"]),
        "AnyObject": {"type": "object"},
    }


# -- Several choices (`n`, a list of prompts) and vLLM's /tokenize, /detokenize ----------------------------
# A separate block (issue 14): `choices_schemas` amends what `schemas` made.


def choices_schemas(found: dict[str, Any]) -> dict[str, Any]:
    """`found` (from `schemas`) with `n` and a completion's list of prompts as the handlers accept them,
    and the bodies of `/tokenize` and `/detokenize`."""
    from gateway.protocol import MAX_N, MAX_PROMPTS  # here, to keep this block apart

    n = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_N}, {"type": "null"}]}
    tokens = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    one = [{"type": "string", "minLength": 1}, tokens]
    prompt = {
        "anyOf": [*one, {"type": "array", "items": {"anyOf": one}, "minItems": 1, "maxItems": MAX_PROMPTS}]
    }
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        found[name]["properties"]["n"] = n
    found["CompletionRequest"]["properties"]["prompt"] = prompt
    message = found["ChatCompletionRequest"]["properties"]["messages"]
    flag = {"type": "boolean"}
    model = found["CompletionRequest"]["properties"]["model"]
    found["TokenizeRequest"] = {
        "anyOf": [
            obj(
                {
                    "model": model,
                    "prompt": {"type": "string"},
                    "add_special_tokens": flag,
                    "return_token_strs": flag,
                },
                ["model", "prompt"],
            ),
            obj(
                {
                    "model": model,
                    "messages": message,
                    "tools": found["ChatCompletionRequest"]["properties"]["tools"],
                    "tool_choice": found["ChatCompletionRequest"]["properties"]["tool_choice"],
                    "add_generation_prompt": flag,
                    "add_special_tokens": flag,
                    "return_token_strs": flag,
                },
                ["model", "messages"],
            ),
        ]
    }
    found["Tokenized"] = obj(
        {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        },
        ["count", "max_model_len", "tokens"],
    )
    found["DetokenizeRequest"] = obj(
        {"model": model, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
        ["model", "tokens"],
    )
    found["Detokenized"] = obj({"prompt": {"type": "string"}}, ["prompt"])
    return found
