"""`GET /openapi.json` describes exactly the app's routes (none missing, none invented), is a document
schemathesis can load, and every error response it documents is the OpenAI error object."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.core.result import Ok
from starlette.routing import Route

from gateway import openapi
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.gateway.live_gateway import live_gateway

METHODS = {"get", "put", "post", "delete", "patch"}


def app_routes() -> set[tuple[str, str]]:
    app = create_app(GatewaySettings("redis://127.0.0.1:1"))  # not started: only its routes are read
    found = set()
    for route in app.routes:
        assert isinstance(route, Route)
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # OpenAPI templates name no converter
        found |= {(path, m.lower()) for m in route.methods or () if m != "HEAD"}
    return found


def documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, m) for path, item in doc["paths"].items() for m in item if m in METHODS}


def test_every_route_is_documented_and_nothing_else() -> None:
    doc = openapi.document()
    assert app_routes() == documented(doc)


def test_path_parameters_match_the_placeholders() -> None:
    for path, item in openapi.document()["paths"].items():
        for method, op in item.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == set(re.findall(r"{(\w+)}", path)), (path, method)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def test_every_operation_documents_its_errors_as_the_error_object() -> None:
    doc = openapi.document()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert op["operationId"] and op["responses"]
            for status, response in op["responses"].items():
                if int(status) >= 400:
                    schema = resolve(doc, response["$ref"])["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (path, method, status)
            if path.startswith("/admin"):
                assert op["security"] == [{"adminToken": []}]
            elif path.startswith("/v1"):
                assert op["security"] == [{"apiKey": []}]


def test_every_ref_resolves_and_schemathesis_loads_every_operation() -> None:
    doc = openapi.document(["tiny"])

    def refs(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for ref in refs(doc):
        resolve(doc, ref)
    schema = schemathesis.openapi.from_dict(doc)
    results = list(schema.get_all_operations())
    assert all(isinstance(result, Ok) for result in results), results
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert {(op.path, op.method.lower()) for op in operations} == documented(doc)


@pytest.fixture
def url(redis_url: str) -> Iterator[str]:
    with live_gateway(redis_url) as base:
        yield base


def test_the_gateway_serves_the_document(url: str) -> None:
    r = httpx.get(f"{url}/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == openapi.document()  # no worker: no live models to list
