"""Bounded reading and parsing of request bodies: what every route that takes a body goes through.

A body is refused on its `Content-Length` before a byte of it is read, and again while it streams in if
it runs past the limit without one. Parsed documents are checked before any handler sees them: nesting
depth, the length of every number (Python refuses to build ints of more than 4,300 digits, and a float
may overflow to infinity), and strings that are not valid Unicode (a JSON `\\ud800` escape decodes to a
lone surrogate, which no tokenizer, Redis client or UTF-8 encoder accepts). Each refusal names the
offending field (`messages[0].content`) as the OpenAI error's `param`.

The time a body may take to arrive is bounded by `ReadLimits` (gateway/read_limits.py), not here.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from gateway.errors import APIError, bad_request

MAX_DEPTH = 32  # an OpenAI chat body nests 5 deep, a routing policy about 8
MAX_NUMBER_CHARS = 64  # a 64-bit seed has 20 digits, a float's shortest repr at most 24 characters
_MAX_INT_BITS = 213  # about 64 decimal digits, for ints that did not come through the JSON parser


class _Refused:
    """Stands in, while parsing, for a number the parser must not build; `check_tree` names its place."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _parse_int(text: str) -> int | _Refused:
    if len(text) > MAX_NUMBER_CHARS:
        return _Refused(f"is a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return int(text)


def _parse_float(text: str) -> float | _Refused:
    if len(text) > MAX_NUMBER_CHARS:
        return _Refused(f"is a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(text)
    return value if math.isfinite(value) else _Refused("is a number out of range")


def _parse_constant(text: str) -> _Refused:
    return _Refused(f"is {text}, which JSON does not allow")


def request_too_large(limit: int, length: int | None = None) -> APIError:
    size = f" ({length} bytes)" if length is not None else ""
    return APIError(
        413,
        f"Request body too large{size}; the limit is {limit} bytes.",
        code="request_too_large",
        headers={
            "Connection": "close"
        },  # the rest of the body is never read: the connection cannot be reused
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to be longer than `limit`."""
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and int(length) > limit:
        raise request_too_large(limit, int(length))
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise request_too_large(limit)
    return bytes(chunks)


def parse_json(raw: bytes) -> Any:
    """The JSON document in `raw`, checked by `check_tree`; 400 when it does not parse or is refused."""
    try:
        doc = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise bad_request(
            f"The request body nests deeper than {MAX_DEPTH} levels.", code="too_deep"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    check_tree(doc)
    return doc


def check_tree(doc: Any, json_types_only: bool = False) -> None:
    """Refuse a document that nests too deep or holds a refused number, a non-finite float or a string
    that is not valid Unicode; with `json_types_only` (YAML), also any value or key JSON cannot hold."""
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]  # iterative: a deep document must not recurse here
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise bad_request(
                    f"'{path or 'body'}' nests deeper than {MAX_DEPTH} levels.", param=path or None
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise bad_request(
                            f"'{path or 'body'}' has a key that is not a string.", param=path or None
                        )
                    _check_string(key, path or None)
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, path or None)
        elif isinstance(value, _Refused):
            raise bad_request(f"'{path or 'body'}' {value.why}.", param=path or None)
        elif isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"'{path or 'body'}' is a number out of range.", param=path or None)
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_INT_BITS:
            raise bad_request(f"'{path or 'body'}' is a number too long.", param=path or None)
        elif json_types_only and value is not None and not isinstance(value, bool | int | float):
            raise bad_request(
                f"'{path or 'body'}' is a {type(value).__name__}, which JSON cannot hold.", param=path or None
            )


def _check_string(text: str, param: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"'{param or 'body'}' holds a lone UTF-16 surrogate (not valid Unicode).", param=param
        ) from None


async def read_json_object(request: Request, limit: int, empty_ok: bool = False) -> dict[str, Any]:
    """The body as a checked JSON object; an empty body is `{}` when `empty_ok`, else refused."""
    raw = await read_body(request, limit)
    if empty_ok and not raw.strip():
        return {}
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body
