"""The OpenAPI 3.1 description of the gateway's whole HTTP API, served at `GET /openapi.json`.

Request schemas say what the handlers accept (gateway/protocol.py, the admin modules), so a fuzzer that
generates from them (schemathesis: tests/gateway/test_fuzz.py, loadtest/fuzz.py) gets past validation,
and every refusal is the `Error` object. tests/gateway/test_openapi.py keeps the paths equal to the app's
routes. The live models are listed as `examples` of `model`, so generated requests can reach a worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.openapi_schemas import NAME, choices_schemas, json_response, obj, ref, schemas

_ERRORS = {
    400: "Invalid request: `param` names the offending field.",
    401: "Missing or invalid bearer token.",
    403: "Not allowed.",
    404: "Not found.",
    408: "The request body did not arrive in time.",
    413: "The request body is too large.",
    429: "Too many requests queued: retry after `Retry-After` seconds.",
    503: "No worker for the model, or the request queue (Redis) is unavailable: retry after `Retry-After`.",
    504: "The model's output did not come in time.",
}


def _op(
    op_id: str,
    summary: str,
    ok: dict[int, dict[str, Any]],
    errors: Iterable[int],
    security: str | None,
    body: dict[str, Any] | None = None,
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    responses: dict[str, Any] = {str(code): resp for code, resp in ok.items()}
    for code in sorted({*errors, 400, 405, 408, 413}):  # what any request can be refused with
        responses[str(code)] = {"$ref": f"#/components/responses/E{code}"}
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "responses": responses}
    if security is not None:
        op["security"] = [{security: []}]
    if body is not None:
        op["requestBody"] = {"required": True, "content": body}
    if params:
        op["parameters"] = params
    return op


def _path_params(*names: str) -> list[dict[str, Any]]:
    return [{"name": n, "in": "path", "required": True, "schema": NAME} for n in names]


def _admin(
    op_id: str, summary: str, ok: dict[int, dict[str, Any]], errors: Iterable[int] = (), **kw: Any
) -> dict[str, Any]:
    return _op(op_id, summary, ok, {401, 403, 503, *errors}, "adminToken", **kw)


def _paths() -> dict[str, Any]:
    return {**_api_paths(), **_admin_paths(), **_policy_paths()}


_ANY_OK = {200: json_response(ref("AnyObject"))}
_NO_CONTENT = {204: {"description": "Done."}}


def _api_paths() -> dict[str, Any]:
    """Health, metrics, this document, and the OpenAI-compatible endpoints."""
    gen_errors = {401, 403, 404, 429, 503, 504}
    decision_link = {
        "GetDecision": {
            "operationId": "getDecision",
            "parameters": {"decision_id": "$response.header.x-loragate-decision"},
        }
    }
    event = obj({"data": {"type": "string"}, "event": {"type": "string"}}, ["data"])  # one server-sent event
    stream = {"text/event-stream": {"schema": event}}
    return {
        "/health": {
            "get": _op(
                "health",
                "Liveness: 200 while a worker serves, else 503.",
                {200: json_response(ref("Health"))},
                {503},
                None,
            )
        },
        "/ready": {
            "get": _op(
                "ready",
                "Readiness: 200 while Redis answers (with or without workers: scale to zero), else 503.",
                _ANY_OK,
                {503},
                None,
            )
        },
        "/metrics": {
            "get": _op(
                "metrics",
                "Prometheus metrics.",
                {200: {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}},
                (),
                None,
            )
        },
        "/openapi.json": {"get": _op("openapi", "This document.", _ANY_OK, (), None)},
        "/v1/models": {
            "get": _op(
                "listModels",
                "Base models and the adapters the key may use.",
                {200: json_response(ref("ModelList"))},
                {401, 503},
                "apiKey",
            )
        },
        "/v1/models/{model}": {
            "get": _op(
                "retrieveModel",
                "One model (a base model, `auto`, or an adapter the key may use).",
                {200: json_response(ref("Model"))},
                {401, 404, 503},
                "apiKey",
                params=_path_params("model"),
            )
        },
        "/v1/completions": {
            "post": _op(
                "createCompletion",
                "A text completion (streamed as server-sent events with `stream`).",
                {
                    200: {
                        "description": "OK",
                        "links": decision_link,
                        "content": {"application/json": {"schema": ref("Completion")}, **stream},
                    }
                },
                gen_errors,
                "apiKey",
                body={"application/json": {"schema": ref("CompletionRequest")}},
            )
        },
        "/tokenize": {
            "post": _op(
                "tokenize",
                "vLLM's tokenize: the token ids of a prompt (or of chat messages) for a model.",
                {200: json_response(ref("Tokenized"))},
                {401, 404, 503},
                "apiKey",
                body={"application/json": {"schema": ref("TokenizeRequest")}},
            )
        },
        "/detokenize": {
            "post": _op(
                "detokenize",
                "vLLM's detokenize: the text of token ids for a model.",
                {200: json_response(ref("Detokenized"))},
                {401, 404, 503},
                "apiKey",
                body={"application/json": {"schema": ref("DetokenizeRequest")}},
            )
        },
        "/v1/chat/completions": {
            "post": _op(
                "createChatCompletion",
                "A chat completion (streamed as server-sent events with `stream`).",
                {
                    200: {
                        "description": "OK",
                        "links": decision_link,
                        "content": {"application/json": {"schema": ref("ChatCompletion")}, **stream},
                    }
                },
                gen_errors,
                "apiKey",
                body={"application/json": {"schema": ref("ChatCompletionRequest")}},
            )
        },
    }


def _admin_paths() -> dict[str, Any]:
    """The fleet, the adapter registry and API keys."""
    adapter_params = _path_params("base", "name")
    adapter_links = {
        "DeleteAdapter": {
            "operationId": "deleteAdapter",
            "parameters": {"base": "$response.body#/base", "name": "$response.body#/name"},
        },
        "PinAdapter": {
            "operationId": "pinAdapter",
            "parameters": {"base": "$response.body#/base", "name": "$response.body#/name"},
        },
    }
    return {
        "/admin/workers": {"get": _admin("listWorkers", "The fleet's workers and their queues.", _ANY_OK)},
        "/admin/models/{model}/demand": {
            "get": _admin(
                "modelDemand",
                "A base model's outstanding requests (its workers' queues + its shared stream): the "
                "autoscaling signal.",
                _ANY_OK,
                {404},
                params=_path_params("model"),
            )
        },
        "/admin/adapters": {"get": _admin("listAdapters", "The adapter registry.", _ANY_OK)},
        "/admin/adapters/{base}/{name}": {
            "put": _admin(
                "putAdapter",
                "Register an adapter directory (under `adapter_roots`).",
                {201: json_response(ref("Adapter"), "Registered.", links=adapter_links)},
                body={"application/json": {"schema": ref("AdapterRegistration")}},
                params=adapter_params,
            ),
            "delete": _admin(
                "deleteAdapter", "Unregister an adapter.", _NO_CONTENT, {404}, params=adapter_params
            ),
        },
        "/admin/adapters/{base}/{name}/pin": {
            "post": _admin(
                "pinAdapter",
                "Keep an adapter resident on its workers (or not).",
                {200: json_response(ref("Adapter"))},
                {404},
                body={"application/json": {"schema": ref("Pin")}},
                params=adapter_params,
            )
        },
        "/admin/keys": {
            "post": _admin(
                "createKey",
                "A new API key for a tenant (shown once).",
                {
                    201: json_response(
                        ref("Key"),
                        "Created.",
                        links={
                            "DeleteKey": {
                                "operationId": "deleteKey",
                                "parameters": {"key_id": "$response.body#/key_id"},
                            }
                        },
                    )
                },
                body={"application/json": {"schema": ref("KeyRequest")}},
            ),
            "get": _admin("listKeys", "Key ids and tenants.", _ANY_OK),
        },
        "/admin/keys/{key_id}": {
            "delete": _admin(
                "deleteKey",
                "Revoke a key by its id (a prefix of 8+ characters).",
                _NO_CONTENT,
                {404},
                params=[{"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            )
        },
    }


def _policy_paths() -> dict[str, Any]:
    """The routing policy, its shadow, statistics and decisions."""
    policy_body = {
        "application/json": {"schema": ref("PolicyDocument")},
        "application/yaml": {"schema": {"type": "string"}},
    }
    return {
        "/admin/policy": {
            "get": _admin("getPolicy", "The active routing policy.", _ANY_OK),
            "put": _admin(
                "putPolicy",
                "Replace the routing policy (validated; a new version).",
                {
                    201: json_response(
                        ref("PolicyVersion"),
                        "Applied.",
                        links={
                            "Rollback": {
                                "operationId": "rollbackPolicy",
                                "requestBody": {"version": "$response.body#/version"},
                            }
                        },
                    )
                },
                body=policy_body,
                params=[{"name": "note", "in": "query", "required": False, "schema": {"type": "string"}}],
            ),
        },
        "/admin/policy/history": {"get": _admin("policyHistory", "Policy versions.", _ANY_OK)},
        "/admin/policy/rollback": {
            "post": _admin(
                "rollbackPolicy",
                "Make an earlier version active again.",
                {201: json_response(ref("AnyObject"), "Done.")},
                {404},
                body={"application/json": {"schema": ref("Rollback")}},
            )
        },
        "/admin/policy/shadow": {
            "get": _admin("getShadow", "The shadow policy and its agreement report.", _ANY_OK),
            "put": _admin(
                "putShadow",
                "Evaluate a policy in the shadow of the active one.",
                {201: json_response(ref("AnyObject"), "Set.")},
                body=policy_body,
            ),
            "delete": _admin("deleteShadow", "Stop shadowing.", _NO_CONTENT),
        },
        "/admin/policy/stats": {"get": _admin("policyStats", "Routing decision statistics.", _ANY_OK)},
        "/admin/decisions/{decision_id}": {
            "get": _admin(
                "getDecision",
                "One routing decision (kept for an hour).",
                _ANY_OK,
                {404},
                params=[
                    {"name": "decision_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
            )
        },
    }


def document(models: Iterable[str] = ()) -> dict[str, Any]:
    """The description; `models` (the live ones) become the examples of every `model` field."""
    errors = {**_ERRORS, 405: "Method not allowed."}
    responses = {f"E{code}": json_response(ref("Error"), text) for code, text in errors.items()}
    for code in (429, 503):
        responses[f"E{code}"]["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "loragate gateway",
            "version": "1",
            "description": "OpenAI-compatible completions over a LoRA-aware fleet, and its admin API. "
            'Every error is `{"error": {"message", "type", "param", "code"}}`.',
        },
        "paths": _paths(),
        "components": {
            "schemas": choices_schemas(schemas(sorted(models))),
            "responses": responses,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "A tenant's API key."},
                "adminToken": {"type": "http", "scheme": "bearer", "description": "The admin token."},
            },
        },
    }
