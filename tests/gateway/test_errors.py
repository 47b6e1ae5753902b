"""OpenAI-style errors: the status decides the error type, and the response carries body, status, headers."""

from __future__ import annotations

import json

import pytest

from gateway.errors import APIError, bad_request, queue_unavailable


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        pytest.param(400, "invalid_request_error", id="400"),
        pytest.param(401, "authentication_error", id="401"),
        pytest.param(403, "permission_error", id="403"),
        pytest.param(404, "not_found_error", id="404"),
        pytest.param(405, "invalid_request_error", id="405"),
        pytest.param(408, "timeout", id="408"),
        pytest.param(413, "invalid_request_error", id="413"),
        pytest.param(429, "rate_limit_error", id="429"),
        pytest.param(431, "invalid_request_error", id="431"),
        pytest.param(499, "client_closed_request", id="499"),
        pytest.param(503, "service_unavailable", id="503"),
        pytest.param(504, "timeout", id="504"),
        pytest.param(500, "api_error", id="unlisted status"),
    ],
)
def test_type_follows_status(status: int, type_: str) -> None:
    assert APIError(status, "m").type == type_


def test_an_explicit_type_wins() -> None:
    assert APIError(400, "m", type_="custom").type == "custom"


def test_body_and_response() -> None:
    error = APIError(404, "No such model.", param="model", code="model_not_found", headers={"X-A": "1"})
    assert str(error) == "No such model."
    body = {
        "error": {
            "message": "No such model.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error.body() == body
    response = error.response()
    assert response.status_code == 404 and response.headers["x-a"] == "1"
    assert json.loads(bytes(response.body)) == body


def test_headers_default_to_none_sent() -> None:
    error = APIError(400, "m")
    assert error.headers == {} and (error.param, error.code) == (None, None)
    assert error.body()["error"] == {
        "message": "m",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_bad_request() -> None:
    error = bad_request("'x' is wrong.", param="x", code="c")
    assert (error.status, error.message, error.param, error.code) == (400, "'x' is wrong.", "x", "c")


def test_queue_unavailable_asks_for_a_retry() -> None:
    error = queue_unavailable()
    assert (error.status, error.code, error.type) == (503, "queue_unavailable", "service_unavailable")
    assert error.headers == {"Retry-After": "2"}
