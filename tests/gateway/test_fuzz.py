"""A short seeded fuzz run against a real stack (a real Redis, a `tiny` worker and a gateway process):
schemathesis over the gateway's OpenAPI document (positive, negative and stateful cases) and Hypothesis-made
raw requests on a socket, 1,100 cases in all. Not one may get a 5xx other than a designed 503, hang past
its 30 s bound, or be refused with anything but the OpenAI error object; responses to valid cases must
match the document. The long run is `python -m loadtest.fuzz --cases 10000`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.fuzz_api import Target, live_models, stateful, stateless
from loadtest.fuzz_raw import raw
from loadtest.fuzz_tally import Tally
from loadtest.procs import rss_mb
from tests.e2e.stack import ADMIN_TOKEN, Stack, flush_redis, running_stack
from worker.modelzoo.make import ZooPaths

pytestmark = pytest.mark.slow
SEED = 20261123


@pytest.fixture(scope="module")
def stack(zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("fuzz-stack"))
    with running_stack(zoo, redis_server, workdir, workers=("fuzz-w1",)) as s:
        yield s
    flush_redis(redis_server)  # what the fuzzer stored (keys, policies, adapters) must not reach other tests


@pytest.fixture(scope="module")
def target(stack: Stack) -> Target:
    return Target(stack.url, "sk-test-alice", ADMIN_TOKEN, timeout_s=30.0)


@pytest.fixture(scope="module")
def rss_at_start(stack: Stack) -> float:
    assert stack.gateway is not None
    return rss_mb(stack.gateway.pid) or 0.0


def verdict(tally: Tally) -> str:
    return "\n".join([str(tally.summary()), *tally.failures])


def test_schemathesis_positive_and_negative_cases(target: Target, rss_at_start: float) -> None:
    tally = Tally()
    stateless(target, tally, 550, SEED)
    assert tally.cases == 550 and tally.ok, verdict(tally)
    assert tally.statuses[200] >= 50, verdict(tally)  # valid cases do reach the worker
    assert sum(n for status, n in tally.statuses.items() if 400 <= status < 500) >= 200, verdict(tally)


def test_schemathesis_stateful_runs(target: Target) -> None:
    tally = Tally()
    stateful(target, tally, 150, SEED)
    assert tally.cases >= 150 and tally.ok, verdict(tally)
    assert tally.statuses[201] > 0 and tally.statuses[204] > 0, verdict(tally)  # links were followed


def test_raw_requests(target: Target) -> None:
    tally = Tally()
    raw(target, tally, 400, SEED, live_models(target))
    assert tally.cases == 400 and tally.ok, verdict(tally)


def test_the_gateway_memory_stays_bounded(stack: Stack, rss_at_start: float) -> None:
    """After the 1,100 cases above (it grew 69 -> 172 MB over 10,000 before the limits)."""
    assert stack.gateway is not None
    grown = (rss_mb(stack.gateway.pid) or 0.0) - rss_at_start
    assert grown < 40, f"gateway RSS grew {grown:.1f} MB"
