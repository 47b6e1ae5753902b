"""Limits on what a client sends, enforced before it is read, against a real uvicorn on a real socket:
header and body read timeouts (slowloris), header and body size, and documents that would crash a
handler (deep nesting, huge numbers, lone surrogates, non-JSON YAML). Every refusal is a 4xx with the
OpenAI error object naming the parameter; none is a 500 and none hangs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import ADMIN_TOKEN
from tests.gateway.live_gateway import closed_by_server, connect, error_of, live_gateway, read_response

KEY = "sk-test-alice"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BODY_ROUTES = [
    ("POST", "/v1/completions", KEY),
    ("POST", "/v1/chat/completions", KEY),
    ("PUT", "/admin/adapters/tiny/x", ADMIN_TOKEN),
    ("POST", "/admin/adapters/tiny/x/pin", ADMIN_TOKEN),
    ("POST", "/admin/keys", ADMIN_TOKEN),
    ("PUT", "/admin/policy", ADMIN_TOKEN),
    ("POST", "/admin/policy/rollback", ADMIN_TOKEN),
    ("PUT", "/admin/policy/shadow", ADMIN_TOKEN),
]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters").resolve()


@pytest.fixture(scope="module")
def url(redis_server: str, adapter_root: Path) -> Iterator[str]:
    roots = (adapter_root,)
    with live_gateway(redis_server, header_timeout_s=1.0, body_timeout_s=1.0, adapter_roots=roots) as base:
        yield base


def head(method: str, path: str, token: str, length: int) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_headers_sent_byte_by_byte_get_408_and_the_connection_is_closed(url: str) -> None:
    with connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        started = time.monotonic()
        answered = b""
        sock.settimeout(0.1)
        while time.monotonic() - started < 5 and not answered:  # a slowloris: a byte every 0.1 s
            try:
                sock.sendall(b"x")
                answered = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        assert answered.startswith(b"HTTP/1.1 408"), answered
        assert time.monotonic() - started < 2.5
        sock.settimeout(3)
        _, _, body = read_response(sock, answered)  # the body may come in a segment of its own
        assert error_of(body)["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(url: str) -> None:
    with connect(url, timeout=4) as sock:
        started = time.monotonic()
        assert closed_by_server(sock)
        assert time.monotonic() - started < 3


def test_headers_beyond_the_size_limit_get_431(url: str) -> None:
    with connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n" + b"X-Filler: " + b"a" * 100_000)
        status, _, body = read_response(sock)
        assert status == 431 and error_of(body)["code"] == "headers_too_large"


@pytest.mark.parametrize(("method", "path", "token"), BODY_ROUTES)
def test_a_trickled_body_gets_408_and_the_connection_is_closed(
    url: str, method: str, path: str, token: str
) -> None:
    with connect(url) as sock:
        sock.sendall(head(method, path, token, 1000))
        started = time.monotonic()
        sock.settimeout(0.2)
        answered = b""
        while time.monotonic() - started < 5 and not answered:
            try:
                sock.sendall(b" " * 10)
                answered = sock.recv(65536)
            except TimeoutError:
                continue
        assert answered.startswith(b"HTTP/1.1 408"), answered
        assert time.monotonic() - started < 2.5
        sock.settimeout(3)
        _, _, body = read_response(sock, answered)  # the body may come in a segment of its own
        assert error_of(body)["code"] == "request_timeout"
        assert closed_by_server(sock)


def test_a_route_that_ignores_its_body_answers_then_closes_the_connection(url: str) -> None:
    with connect(url, timeout=5) as sock:
        sock.sendall(head("GET", "/health", KEY, 1000) + b"x" * 10)  # and the rest never comes
        status, _, _ = read_response(sock)
        assert status in (200, 503)  # no worker in this test: 503 is /health's answer
        sock.settimeout(3)
        assert closed_by_server(sock)  # it could not carry another request: the trickler is let go


@pytest.mark.parametrize(("method", "path", "token"), BODY_ROUTES)
def test_a_body_announced_too_large_is_refused_before_it_is_sent(
    url: str, method: str, path: str, token: str
) -> None:
    with connect(url, timeout=3) as sock:
        sock.sendall(head(method, path, token, 10**9))  # and not a byte of the body
        status, headers, body = read_response(sock)
        assert status == 413 and error_of(body)["code"] == "request_too_large"
        assert headers["connection"] == "close"


@pytest.mark.parametrize(
    ("path", "limit"),
    [("/admin/policy", 256 * 1024), ("/admin/keys", 4096), ("/admin/adapters/tiny/x", 65536)],
)
def test_admin_routes_check_their_own_smaller_limit_before_reading(url: str, path: str, limit: int) -> None:
    method = "POST" if path == "/admin/keys" else "PUT"
    with connect(url, timeout=3) as sock:
        sock.sendall(head(method, path, ADMIN_TOKEN, limit + 1))
        status, _, body = read_response(sock)
        assert status == 413, body


@pytest.mark.parametrize("path", ["/v1/models", "/admin/workers"])
def test_a_non_ascii_bearer_token_is_401(url: str, path: str) -> None:
    with connect(url, timeout=5) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: t\r\n".encode() + b"Authorization: Bearer \xc3\xa9\xff\r\n\r\n"
        )
        status, _, body = read_response(sock)
        assert status == 401 and error_of(body)["code"] == "invalid_api_key"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def completion(extra: str) -> str:
    return '{"model": "tiny", "prompt": "x", ' + extra + "}"


CHAT = '{"model": "tiny", "messages": [{"role": "user", "content": %s}]%s}'
CASES = [  # (path, raw body, status, param)
    (
        "/v1/completions",
        '{"model": "tiny", "prompt": "x", "max_tokens": 1%s}' % ("0" * 5000),
        400,
        "max_tokens",
    ),
    ("/v1/completions", completion(f'"seed": {2**64}'), 400, "seed"),
    ("/v1/completions", completion(f'"seed": {-(2**63) - 1}'), 400, "seed"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "top_p": 1e999}', 400, "top_p"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', 400, "model"),
    ("/v1/completions", completion(f'"user": {nested(1000)}'), 400, None),
    (
        "/v1/completions",
        completion(f'"user": {nested(40)}'),
        400,
        "user" + "[0]" * 31,
    ),
    ("/v1/completions", '{"model": "tiny", "prompt": ["\\udfff"]}', 400, "prompt[0]"),
    ("/v1/chat/completions", CHAT % ('"a\\udc00b"', ""), 400, "messages[0].content"),
    (
        "/v1/chat/completions",
        CHAT % ('[{"type": "text", "text": 5}]', ""),
        400,
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", CHAT % ('[{"type": "image"}]', ""), 400, "messages[0].content[0]"),
    ("/v1/chat/completions", CHAT % ('"hi"', ', "ignore_eos": "yes"'), 400, "ignore_eos"),
    ("/v1/chat/completions", '{"\\ud800": 1}', 400, None),
    ("/admin/policy/rollback", "{not json", 400, None),
    ("/admin/policy/rollback", '{"version": "1"}', 400, "version"),
    ("/admin/adapters/tiny/x", '{"path": "/tmp/a\\u0000b"}', 400, "path"),
    ("/admin/adapters/tiny/x", json.dumps({"path": "/" + "a" * 5000}), 400, "path"),
    ("/admin/keys", '{"tenant": 1%s}' % ("0" * 100), 400, "tenant"),
]


@pytest.mark.parametrize(("path", "raw", "status", "param"), CASES)
def test_bad_documents_are_400_naming_the_parameter(
    url: str, path: str, raw: str, status: int, param: str | None
) -> None:
    method = "PUT" if path.startswith("/admin/adapters") else "POST"
    headers = {**(ADMIN if path.startswith("/admin") else AUTH), "Content-Type": "application/json"}
    r = httpx.request(method, url + path, content=raw.encode(), headers=headers, timeout=10)
    assert r.status_code == status, r.text
    assert error_of(r.content)["param"] == param


def test_an_adapter_path_the_filesystem_refuses_is_400(url: str, adapter_root: Path) -> None:
    long_name = str(adapter_root / ("a" * 300) / "b")  # inside the roots, but a name too long (ENAMETOOLONG)
    r = httpx.put(f"{url}/admin/adapters/tiny/x", json={"path": long_name}, headers=ADMIN, timeout=5)
    assert r.status_code == 400 and error_of(r.content)["param"] == "path", r.text


YAML = {"Content-Type": "application/yaml"}
POLICIES = [  # (raw body, content type header): each a malformed policy document
    ("a: &a [1, 2]\nb: &b [*a, *a]\nc: [*b, *b]\n", YAML),  # aliases: an expansion bomb
    ("plugins: []\nprofiles: []\nwhen: 2024-01-01\n", YAML),  # a date, which JSON cannot hold
    ("? [1, 2]\n: x\n", YAML),  # a key that is a list
    ("x: " + "[" * 2000 + "]" * 2000 + "\n", YAML),
    ("x: 1" + "0" * 5000 + "\n", YAML),
    ("x: .nan\n", YAML),
    ("x: !!binary aGVsbG8=\n", YAML),
    ("- just\n- a list\n", YAML),
    ('"\\ud800": 1\n', YAML),
    ("[1, 2]", {}),
    ('{"plugins": 5, "profiles": {"a": []}}', {}),
    ('{"plugins": [{"type": {"x": 1}}], "profiles": [{"name": []}]}', {}),
    ('{"plugins": [null, 5, "x"], "profiles": [null]}', {}),
    ("{" * 100 + "}" * 100, {}),
]


@pytest.mark.parametrize("route", ["/admin/policy", "/admin/policy/shadow"])
@pytest.mark.parametrize(("raw", "headers"), POLICIES)
def test_malformed_policy_documents_are_400(url: str, route: str, raw: str, headers: dict[str, str]) -> None:
    r = httpx.put(url + route, content=raw.encode(), headers={**ADMIN, **headers}, timeout=10)
    assert r.status_code == 400, r.text
    error_of(r.content)
