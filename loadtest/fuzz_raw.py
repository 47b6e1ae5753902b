"""Hypothesis-generated raw requests on a bare socket: bytes no HTTP client library would send. Paths of
every route and beyond, headers of any latin-1 bytes (bearer tokens included), and bodies that are random
bytes, random JSON (huge integers, lone surrogates, deep nesting, non-finite numbers) or a valid request
with one field replaced. Each request says `Connection: close`, so its response is read to the end of the
connection, within the hang bound."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from loadtest.fuzz_api import Target, costly_budget
from loadtest.fuzz_tally import Tally

# fmt: off
ROUTES = [  # the real ones (a random method and path are drawn too)
    ("GET", "/health"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/v1/models"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/admin/workers"),
    ("GET", "/admin/adapters"), ("PUT", "/admin/adapters/tiny/x"), ("DELETE", "/admin/adapters/tiny/x"),
    ("POST", "/admin/adapters/tiny/x/pin"), ("POST", "/admin/keys"), ("GET", "/admin/keys"),
    ("DELETE", "/admin/keys/0123456789"), ("GET", "/admin/policy"), ("PUT", "/admin/policy"),
    ("GET", "/admin/policy/history"), ("POST", "/admin/policy/rollback"), ("GET", "/admin/policy/shadow"),
    ("PUT", "/admin/policy/shadow"), ("DELETE", "/admin/policy/shadow"), ("GET", "/admin/policy/stats"),
    ("GET", "/admin/decisions/d-1"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/v1/models/tiny"),
]
# fmt: on
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]

json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**60, max_value=10**4000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
)
json_values = st.recursive(
    json_leaves,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=20,
)
# fmt: off
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stream", "stream_options", "n", "user", "ignore_eos", "logprobs", "path", "tenants",
    "pinned", "tenant", "version", "plugins", "profiles", "echo", "top_logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "stop_token_ids",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "guided_regex", "guided_choice",
    "guided_json", "guided_grammar", "structured_outputs", "tokens",
]
# fmt: on


@st.composite
def bodies(draw: st.DrawFn, models: list[str]) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "mutated", "deep", "number", "constant"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "deep":
        depth = draw(st.integers(1, 3000))
        return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "number":
        digits = draw(st.integers(1, 20000))
        return b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * digits + b"}"
    if kind == "constant":
        constant = draw(st.sampled_from([b"NaN", b"Infinity", b"-1e999"]))
        return b'{"model": "tiny", "prompt": "x", "temperature": ' + constant + b"}"
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": draw(st.sampled_from(models or ["tiny"])), "max_tokens": 4}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
        if chat
        else {"prompt": "hi"}
    )
    # Any value but a token budget a worker would spend a long time on (the hang bound is for the server).
    body[draw(st.sampled_from(FIELDS))] = draw(json_values.filter(lambda v: not costly_budget(v)))
    return json.dumps(body).encode()


header_value = st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@st.composite
def raw_requests(draw: st.DrawFn, target: Target, models: list[str]) -> tuple[str, bytes]:
    if draw(st.integers(0, 3)):
        method, path = draw(st.sampled_from(ROUTES))
    else:
        method = draw(st.sampled_from(METHODS))
        path = draw(
            st.sampled_from([p for _, p in ROUTES])
            | st.text(alphabet="/abcdv1%0?&=.-_", max_size=40).map(lambda p: "/" + p)
        )
    right = target.admin_token if path.startswith("/admin") else target.api_key
    token = draw(
        st.sampled_from([right.encode()] * 4 + [target.api_key.encode(), target.admin_token.encode()])
        | st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
    )
    body = draw(bodies(models)) if draw(st.integers(0, 9)) else b""
    headers = [b"Host: fuzz", b"Connection: close", b"Authorization: Bearer " + token]
    if draw(st.booleans()):
        kind = draw(st.sampled_from([b"application/json", b"application/yaml"]) | header_value)
        headers.append(b"Content-Type: " + kind)
    for name, value in draw(
        st.lists(st.tuples(st.from_regex(rb"\A[A-Za-z-]{1,20}\Z"), header_value), max_size=3)
    ):
        if name.lower() not in (b"content-length", b"transfer-encoding", b"connection", b"host"):
            headers.append(name + b": " + value)
    head = f"{method} {path} HTTP/1.1\r\n".encode() + b"\r\n".join(headers)
    return f"{method} {path} body={body[:120]!r}", head + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def exchange(target: Target, raw: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """Sends `raw`, reads the response to the connection's end; None when none came within the bound."""
    host, port = target.base_url.removeprefix("http://").split(":")
    deadline = time.monotonic() + target.timeout_s
    data = b""
    try:
        with socket.create_connection((host, int(port)), timeout=target.timeout_s) as sock:
            sock.sendall(raw)
            while time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            else:
                return None
    except TimeoutError:
        return None
    except (ConnectionResetError, BrokenPipeError):
        pass  # the server closed early (it refused before reading everything): judge what it sent
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1.1 "):
        return None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return int(lines[0].split()[1]), headers, body


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + rest[:size], rest[size + 2 :]
    return out


def raw(target: Target, tally: Tally, n: int, seed: int, models: list[str]) -> None:
    """`n` raw requests."""

    @hypothesis.seed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(raw_requests(target, models))
    def run(request: tuple[str, bytes]) -> None:
        what, data = request
        answer = exchange(target, data)
        if answer is None:
            tally.hang("raw", what)
            return
        status, headers, body = answer
        path = what.split()[1].split("?")[0]
        tally.record("raw", what, path, status, headers, b"" if what.startswith("HEAD") else body)

    run()
