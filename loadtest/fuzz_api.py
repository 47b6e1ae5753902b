"""Schemathesis over the gateway's own OpenAPI document (`GET /openapi.json`): stateless cases, valid
(positive) and schema-violating (negative), and stateful runs that follow the document's links (a created
key is deleted, a registered adapter pinned, a completion's routing decision fetched).

Two adjustments make valid cases reach a worker at a bounded cost: most positive completion requests name
a live model (a random string would only ever get 404), and their `max_tokens` is at most 16 (a chat
without one would generate up to the context length). Each request carries the right bearer token for its
operation, sometimes none or a wrong one. Responses to positive cases are also checked against the
document (status code, content type, body schema).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test
from schemathesis import Case, GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from loadtest.fuzz_tally import Tally

CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATING = {"/v1/completions", "/v1/chat/completions"}


@dataclass(frozen=True)
class Target:
    base_url: str
    api_key: str
    admin_token: str
    timeout_s: float = 30.0  # a request unanswered after this is a hang


def _settings(n: int, **extra: Any) -> settings:
    return settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # failures are tallied, not raised: nothing to shrink
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        **extra,
    )


class _Caller:
    """Adjusts, sends and tallies one case; `pick` makes the choices (a Hypothesis draw or a seeded RNG)."""

    def __init__(self, target: Target, tally: Tally, models: list[str], phase: str):
        self.target, self.tally, self.models, self.phase = target, tally, models, phase

    def adjust(self, case: Case, pick: Callable[[list[Any]], Any]) -> dict[str, str]:
        security = case.operation.definition.raw.get("security") or [{}]
        token = {"adminToken": self.target.admin_token, "apiKey": self.target.api_key}.get(
            next(iter(security[0]), "")
        )
        auth = pick(["right"] * 18 + ["none", "wrong"]) if token else "none"
        headers = (
            {"Authorization": f"Bearer {token if auth == 'right' else 'sk-wrong'}"} if auth != "none" else {}
        )
        body = case.body
        if case.operation.path in GENERATING and isinstance(body, dict):
            if self.models and pick([True, True, True, False]):
                body["model"] = pick(self.models)
            for name in ("max_tokens", "max_completion_tokens"):
                if costly_budget(body.get(name)):
                    body[name] = pick(list(range(1, 17)))
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = pick(list(range(1, 17)))  # else a chat runs to the context length
        return headers

    def send(self, case: Case, headers: dict[str, str], conformance: bool) -> Any:
        what = f"{case.operation.method.upper()} {case.formatted_path} body={str(case.body)[:200]}"
        try:
            response = case.call(
                base_url=self.target.base_url, headers=headers, timeout=self.target.timeout_s
            )
        except requests.Timeout:
            self.tally.hang(self.phase, what)
            return None
        except requests.ConnectionError as e:  # the server dropped the connection without an answer
            self.tally.hang(self.phase, f"{what} (connection error {e!r})")
            return None
        except (requests.exceptions.InvalidURL, requests.exceptions.InvalidHeader, UnicodeError, ValueError):
            return None  # a request the client library refuses to send: nothing reached the server
        flat = {k: v[0] if isinstance(v, list) else v for k, v in response.headers.items()}
        self.tally.record(self.phase, what, case.operation.path, response.status_code, flat, response.content)
        if conformance:
            try:
                case.validate_response(response, checks=CONFORMANCE)
            except (AssertionError, FailureGroup) as e:  # tallied, not fatal
                self.tally.mismatch(self.phase, what, str(e)[:300])
        return response


def costly_budget(value: object) -> bool:
    """A token budget a worker would spend (larger ones are refused before any work)."""
    return isinstance(value, int) and not isinstance(value, bool) and 16 < value <= 1 << 16


def live_models(target: Target) -> list[str]:
    r = requests.get(
        f"{target.base_url}/v1/models", headers={"Authorization": f"Bearer {target.api_key}"}, timeout=10
    )
    r.raise_for_status()
    return [m["id"] for m in r.json()["data"]]


def stateless(target: Target, tally: Tally, n: int, seed: int) -> None:
    """`n` cases over every operation, half positive and half negative."""
    schema = schemathesis.openapi.from_url(f"{target.base_url}/openapi.json", timeout=10)
    operations = [result.ok() for result in schema.get_all_operations() if isinstance(result, Ok)]
    caller = _Caller(target, tally, live_models(target), "schemathesis")
    strategies: dict[tuple[int, GenerationMode], Any] = {}

    @hypothesis.seed(seed)
    @_settings(n)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(operations) - 1))
        mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
        if (index, mode) not in strategies:
            strategies[index, mode] = operations[index].as_strategy(generation_mode=mode)
        case = data.draw(strategies[index, mode])
        headers = caller.adjust(case, lambda options: data.draw(st.sampled_from(options)))
        caller.send(case, headers, conformance=mode is GenerationMode.POSITIVE)

    run()


def stateful(target: Target, tally: Tally, n: int, seed: int) -> None:
    """Runs of linked steps (state machine from the document's links) until `n` steps are done."""
    schema = schemathesis.openapi.from_url(f"{target.base_url}/openapi.json", timeout=10)
    caller = _Caller(target, tally, live_models(target), "stateful")
    rng = random.Random(seed)
    base = schema.as_state_machine()

    class Machine(base):  # type: ignore[misc, valid-type]
        def call(self, case: Case, **kwargs: Any) -> Any:
            headers = caller.adjust(case, rng.choice)
            response = caller.send(case, headers, conformance=True)
            if response is None:
                raise _NoResponse()
            return response

        def validate_response(self, response: Any, case: Case, *args: Any, **kwargs: Any) -> None:
            pass  # `call` tallied it

    start, runs = tally.phases["stateful"], 0
    while tally.phases["stateful"] - start < n:
        left = n - (tally.phases["stateful"] - start)
        runs += 1
        seeded = hypothesis.seed(seed + runs)(Machine)  # a seed on the class seeds the run
        try:
            with with_reporter(lambda _: None):  # Hypothesis would print the steps of a flaky run
                run_state_machine_as_test(
                    seeded, settings=_settings(max(1, left // 10), stateful_step_count=10)
                )
        except _NoResponse:
            continue  # tallied as a hang; start a fresh run
        except Flaky:
            # Which links a run can follow depends on the server's answers, so Hypothesis may find a run
            # that drew differently from an earlier one with the same start; every step is tallied already.
            continue


class _NoResponse(Exception):
    pass
