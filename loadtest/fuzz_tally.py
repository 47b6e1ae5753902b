"""What the fuzzer counts, and what counts as a failure: any status >= 500 other than a designed 503
(`queue_unavailable` or `no_worker` with `Retry-After`, or `/health` saying no worker serves), an error
response (>= 400) that is not the OpenAI error object, and a request that gets no answer in time (a hang)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

DESIGNED_503 = {"queue_unavailable", "no_worker"}


def error_shape_ok(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    error = doc.get("error") if isinstance(doc, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and isinstance(error["type"], str)
        and all(error[k] is None or isinstance(error[k], str) for k in ("param", "code"))
    )


def designed_503(path: str, headers: Mapping[str, str], body: bytes) -> bool:
    try:
        doc: Any = json.loads(body)
    except ValueError:
        return False
    if path == "/health":
        return isinstance(doc, dict) and doc.get("status") == "unavailable"
    code = (
        doc.get("error", {}).get("code")
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict)
        else None
    )
    return code in DESIGNED_503 and "retry-after" in {k.lower() for k in headers}


@dataclass
class Tally:
    cases: int = 0
    status_5xx: int = 0
    hangs: int = 0
    bad_errors: int = 0
    schema_mismatches: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # the first few of each kind, described
    _kinds: Counter[str] = field(default_factory=Counter)
    on_case: Callable[[], None] | None = None

    def record(
        self, phase: str, what: str, path: str, status: int, headers: Mapping[str, str], body: bytes
    ) -> None:
        head = what.startswith("HEAD ")  # an answer to HEAD has no body to judge
        self._count(phase)
        self.statuses[status] += 1
        if status >= 500 and not (status == 503 and designed_503(path, headers, body)):
            self.status_5xx += 1
            self._fail("5xx", f"{status} on {what}: {body[:300]!r}")
        elif status >= 400 and not head and path != "/health" and not error_shape_ok(body):
            self.bad_errors += 1
            self._fail("shape", f"{status} not the error object on {what}: {body[:300]!r}")

    def hang(self, phase: str, what: str) -> None:
        self._count(phase)
        self.hangs += 1
        self._fail("hang", f"no answer in time to {what}")

    def mismatch(self, phase: str, what: str, why: str) -> None:
        self.schema_mismatches += 1
        self._fail("schema", f"response differs from the OpenAPI document on {what}: {why}")

    @property
    def ok(self) -> bool:
        return self.status_5xx == self.hangs == self.bad_errors == self.schema_mismatches == 0

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "status_5xx": self.status_5xx,
            "hangs": self.hangs,
            "bad_error_bodies": self.bad_errors,
            "schema_mismatches": self.schema_mismatches,
            "by_phase": dict(sorted(self.phases.items())),
            "by_status": {str(k): v for k, v in sorted(self.statuses.items())},
        }

    def _count(self, phase: str) -> None:
        self.cases += 1
        self.phases[phase] += 1
        if self.on_case is not None:
            self.on_case()

    def _fail(self, kind: str, text: str) -> None:
        self._kinds[kind] += 1
        if self._kinds[kind] <= 5:  # the first few of each kind
            self.failures.append(text)
