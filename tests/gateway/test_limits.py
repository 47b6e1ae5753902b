"""Bounded body reading and checked JSON: every refusal is the right status and names the field."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import pytest
from starlette.requests import Request
from starlette.types import Message

from gateway.errors import APIError
from gateway.limits import MAX_DEPTH, check_tree, parse_json, read_body, read_json_object, request_too_large


def _refusal(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as e:
        call(*args)
    return e.value


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# (raw body, param named, code, words in the message)
PARSE_ERRORS = [
    pytest.param(b"{", None, "invalid_json", "not valid JSON", id="broken JSON"),
    pytest.param(b"", None, "invalid_json", "not valid JSON", id="empty"),
    pytest.param(b'{"a": "\xff"}', None, "invalid_json", "not valid JSON", id="not UTF-8"),
    pytest.param(_nested(100_000), None, "too_deep", "nests deeper", id="deep enough to recurse"),
    # the first list at depth MAX_DEPTH is named
    pytest.param(
        _nested(MAX_DEPTH + 1), "[0]" * MAX_DEPTH, None, "nests deeper than 32", id="one level too deep"
    ),
    pytest.param(
        b'{"a": {"b": ' + _nested(MAX_DEPTH) + b"}}",
        "a.b" + "[0]" * 30,
        None,
        "nests deeper",
        id="deep field",
    ),
    pytest.param(b'{"seed": ' + b"9" * 65 + b"}", "seed", None, "65 characters", id="long integer"),
    pytest.param(b'{"t": 0.' + b"1" * 64 + b"}", "t", None, "characters", id="long float"),
    pytest.param(b'{"t": 1e999}', "t", None, "out of range", id="float overflows"),
    pytest.param(b'{"t": NaN}', "t", None, "NaN, which JSON does not allow", id="NaN"),
    pytest.param(b'{"t": [-Infinity]}', "t[0]", None, "-Infinity", id="infinity in a list"),
    pytest.param(
        b'{"messages": [{"content": "\\ud800"}]}',
        "messages[0].content",
        None,
        "surrogate",
        id="lone surrogate",
    ),
    pytest.param(b'{"\\udfff": 1}', None, None, "surrogate", id="surrogate in a top-level key"),
    pytest.param(b'"\\ud800"', None, None, "'body' holds a lone", id="surrogate document"),
]


@pytest.mark.parametrize(("raw", "param", "code", "words"), PARSE_ERRORS)
def test_parse_json_refuses(raw: bytes, param: str | None, code: str | None, words: str) -> None:
    error = _refusal(parse_json, raw)
    assert (error.status, error.param, error.code) == (400, param, code)
    assert words in error.message, error.message


def test_parse_json_accepts_what_fits() -> None:
    raw = (
        b'{"seed": 18446744073709551615, "t": 0.5, "s": "\\ud83d\\ude00 caf\\u00e9", "n": '
        + _nested(30)
        + b"}"
    )
    doc = parse_json(raw)
    assert doc["seed"] == 2**64 - 1 and doc["t"] == 0.5 and doc["s"] == "😀 café"


@pytest.mark.parametrize(
    ("doc", "param", "words"),
    [
        pytest.param({"d": datetime.date(2026, 1, 1)}, "d", "is a date", id="a YAML date"),
        pytest.param({1: "x"}, None, "key that is not a string", id="an integer key"),
        pytest.param({"a": {(1, 2): "x"}}, "a", "key that is not a string", id="a nested tuple key"),
        pytest.param({"a": [float("inf")]}, "a[0]", "out of range", id="infinity"),
        pytest.param({"a": 10**70}, "a", "too long", id="a huge int"),
    ],
)
def test_check_tree_json_types_only(doc: Any, param: str | None, words: str) -> None:
    error = _refusal(check_tree, doc, True)
    assert error.param == param and words in error.message, error.message


def test_check_tree_lets_json_values_through() -> None:
    check_tree({"a": [None, True, 1, 1.5, "x", {"b": []}]}, json_types_only=True)
    check_tree({"d": datetime.date(2026, 1, 1)})  # without json_types_only, other values pass


def test_request_too_large() -> None:
    error = request_too_large(10, 20)
    assert (error.status, error.code, error.headers) == (413, "request_too_large", {"Connection": "close"})
    assert "(20 bytes)" in error.message and "limit is 10 bytes" in error.message
    assert "bytes)" not in request_too_large(10).message


def _request(chunks: list[bytes], content_length: int | None = None) -> Request:
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    messages: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]

    async def receive() -> Message:
        return messages.pop(0)

    return Request({"type": "http", "headers": headers}, receive)


@pytest.mark.parametrize(
    ("chunks", "content_length", "expected"),
    [
        pytest.param([b"abc", b"de"], 5, b"abcde", id="announced, at the limit"),
        pytest.param([b"abc", b"de"], None, b"abcde", id="streamed, at the limit"),
        pytest.param([b""], 0, b"", id="empty"),
    ],
)
def test_read_body(chunks: list[bytes], content_length: int | None, expected: bytes) -> None:
    assert asyncio.run(read_body(_request(chunks, content_length), 5)) == expected


@pytest.mark.parametrize(
    ("chunks", "content_length", "size"),
    [
        pytest.param([b"x"], 6, "(6 bytes)", id="announced too long: refused unread"),
        pytest.param([b"abc", b"def"], None, "large;", id="streamed past the limit"),
        pytest.param([b"abc", b"def"], 2, "large;", id="longer than announced"),
    ],
)
def test_read_body_refuses(chunks: list[bytes], content_length: int | None, size: str) -> None:
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(_request(chunks, content_length), 5))
    assert e.value.status == 413 and size in e.value.message


@pytest.mark.parametrize(
    ("body", "empty_ok", "expected"),
    [
        pytest.param(b'{"a": 1}', False, {"a": 1}, id="an object"),
        pytest.param(b"  ", True, {}, id="blank, empty allowed"),
    ],
)
def test_read_json_object(body: bytes, empty_ok: bool, expected: dict[str, Any]) -> None:
    assert asyncio.run(read_json_object(_request([body]), 100, empty_ok)) == expected


@pytest.mark.parametrize(
    ("body", "words"),
    [
        pytest.param(b"[1]", "must be a JSON object", id="a list"),
        pytest.param(b"", "not valid JSON", id="empty, not allowed"),
    ],
)
def test_read_json_object_refuses(body: bytes, words: str) -> None:
    with pytest.raises(APIError) as e:
        asyncio.run(read_json_object(_request([body]), 100))
    assert (e.value.status, e.value.code) == (400, "invalid_json") and words in e.value.message
