"""Redis outages against a stack of real processes (gateway and workers) on a redis-server of the module's
own, which each test crashes (SIGKILL) and restarts, with persistence (AOF, `appendfsync everysec`) or
without; `$REDIS_URL` plays no part. No process is restarted by hand: the stack is started once and each
test finds it on a fresh, empty Redis (itself a crash the stack has ridden out).

- While Redis is gone, a request gets 503 `queue_unavailable` with `Retry-After` at once, not a hang.
- Streams running when Redis crashes finish, token for token equal to an undisturbed greedy run, even
  when Redis comes back empty and when the outage outlasts the heartbeat TTL and the backoff cap; new
  requests succeed within seconds of Redis's return.
- Requests still queued (no worker had read them) when Redis restarts are served if Redis kept them,
  and fail at once with 503 `queue_unavailable` if it lost them (not after the 300 s first-event timeout).

Each test prints one JSON line with its figures (run with `-s` to see them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import pytest

from loragate import contracts
from loragate.redis_retry import BACKOFF_CAP_S
from tests.e2e.stack import Stack
from tests.redis_process import RedisProcess, redis_process
from worker.modelzoo.make import ZooPaths

KEY = {"Authorization": "Bearer sk-test-alice"}
STREAMS = 12
MAX_TOKENS = 160
# The queued requests' length: they prove they were kept (or refused) across the restart, and are served
# token-exact, for which a few tokens do; 160 each on the one worker cost seconds after Redis's return.
QUEUED_TOKENS = 16


def body(i: int, **extra: object) -> dict[str, object]:
    return {
        "model": "tiny",
        "prompt": f"def handler_{i}(event, context):",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


WORKERS = ("w1", "w2")


@dataclass
class Shared:
    stack: Stack
    server: RedisProcess
    used: bool = False


@pytest.fixture(scope="module")
def shared(zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """The module's stack (two workers and a gateway) on a redis-server of its own, started once: each
    test that crashes Redis under a running stack takes it through `outage_stack`."""
    with redis_process(persistent=False) as server:
        stack = Stack(zoo, server.url, tmp_path_factory.mktemp("stack"), worker_count=len(WORKERS))
        try:
            for w in WORKERS:
                stack.start_worker(w)
            stack.start_gateway()
            stack.wait_ready(workers=len(WORKERS))
            yield Shared(stack, server)
        finally:
            if server.proc is None:  # let the workers drain instead of waiting for Redis
                server.start()
            stack.stop()


@contextlib.contextmanager
def outage_stack(shared: Shared, persistent: bool) -> Iterator[tuple[Stack, RedisProcess]]:
    """The module's stack on an empty Redis with persistence or without: after an earlier test, a fresh
    redis-server on the same socket (the stack rides that out as any crash), once every worker's heartbeat
    is back on it and a request is served. The processes are the module's, started once: a stack start per
    test cost ~5 s."""
    stack, server = shared.stack, shared.server
    if shared.used or server.persistent != persistent:
        server.start_fresh(persistent)
        r = server.client()
        beats = [contracts.worker_state("tiny", w) for w in WORKERS]
        wait_for(lambda: r.exists(*beats) == len(beats), 30, "every worker's heartbeat on the fresh Redis")
        r.close()
        first_success_after(stack.url, time.monotonic())
    shared.used = True
    for name, proc in [("gateway", stack.gateway), *stack.workers.items()]:
        assert proc is not None and proc.poll() is None, f"{name} exited: {stack.logs()}"
    try:
        yield stack, server
    finally:
        if server.proc is None:
            server.start()


def complete(url: str, payload: dict[str, object], timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=payload, headers=KEY, timeout=timeout)


@pytest.fixture(scope="module")
def answers() -> dict[tuple[int, int], str]:
    """The module's undisturbed greedy answers by (prompt index, max tokens), asked once (every test's
    stack serves the same checkpoint greedily, so one stack's answers are every stack's)."""
    return {}


def references(
    url: str, n: int, known: dict[tuple[int, int], str], max_tokens: int = MAX_TOKENS
) -> list[str]:
    """The undisturbed greedy answers to prompts 0..n-1, before any outage; those not in `known` are asked
    of the stack at `url` now (and added)."""
    missing = [i for i in range(n) if (i, max_tokens) not in known]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(missing))) as pool:
        replies = list(
            pool.map(lambda i: complete(url, body(i, max_tokens=max_tokens), timeout=120), missing)
        )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    known.update(
        ((i, max_tokens), r.json()["choices"][0]["text"]) for i, r in zip(missing, replies, strict=True)
    )
    return [known[i, max_tokens] for i in range(n)]


@dataclass
class StreamResult:
    chunks: int = 0
    text: str = ""
    finish: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def stream(url: str, i: int, out: StreamResult) -> None:
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body(i, stream=True), headers=KEY, timeout=90
        ) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {resp.read().decode()}"
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])
                    continue
                choice = chunk["choices"][0]
                out.text += choice["text"]
                out.finish = choice["finish_reason"] or out.finish
                out.chunks += 1
    except httpx.HTTPError as e:
        out.error = repr(e)
    finally:
        out.done.set()


def first_success_after(url: str, started: float, limit: float = 30.0) -> float:
    """Seconds from `started` (Redis back) to the first request answered 200."""
    probe = body(999, max_tokens=4)
    while time.monotonic() - started < limit:
        with contextlib.suppress(httpx.HTTPError):
            if complete(url, probe, timeout=10).status_code == 200:
                return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"no request succeeded within {limit} s of Redis's return")


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_request_gets_503_at_once_while_redis_is_gone(shared: Shared) -> None:
    short = body(0, max_tokens=2)
    with outage_stack(shared, persistent=False) as (stack, server):
        assert complete(stack.url, short).status_code == 200
        server.kill()
        time.sleep(0.2)  # the gateway still has its last view of the fleet, a second old at most
        started = time.monotonic()
        resp = complete(stack.url, short, timeout=30)
        took = time.monotonic() - started
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "2"
        assert resp.json()["error"]["code"] == "queue_unavailable", stack.logs()
        assert took < 2.0, f"a 503 took {took:.1f} s"
        server.start()
        back = time.monotonic()
        recovered = first_success_after(stack.url, back)
        figures = {"test": "503 while gone", "latency_503_s": round(took, 3), "recovery_s": recovered}
        print(json.dumps(figures))
        assert recovered < 10


@pytest.mark.parametrize(
    ("persistent", "outage_s"),
    [(True, 2.0), (False, 2.0), (False, 2.0 + max(contracts.HEARTBEAT_TTL_S, BACKOFF_CAP_S) * 2)],
    ids=["aof-2s", "no-persistence-2s", "no-persistence-long"],
)
def test_streams_ride_out_a_redis_crash_and_new_requests_succeed_soon_after(
    shared: Shared, answers: dict[tuple[int, int], str], persistent: bool, outage_s: float
) -> None:
    with outage_stack(shared, persistent) as (stack, server):
        expected = references(stack.url, STREAMS, answers)
        results = [StreamResult() for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=stream, args=(stack.url, i, results[i]), daemon=True)
            for i in range(STREAMS)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: all(r.chunks >= 5 or r.done.is_set() for r in results), 120, "every stream to start")
        in_flight = sum(not r.done.is_set() for r in results)
        server.kill()
        killed = time.monotonic()
        during = complete(stack.url, body(500, max_tokens=2), timeout=30)
        assert during.status_code == 503 and during.json()["error"]["code"] == "queue_unavailable"
        time.sleep(max(0.0, outage_s - (time.monotonic() - killed)))
        server.start()
        back = time.monotonic()
        recovered = first_success_after(stack.url, back)
        for t in threads:
            t.join(timeout=180)
        hung = sum(t.is_alive() for t in threads)
        errored = sum(r.error is not None for r in results)
        finished = [i for i, r in enumerate(results) if r.error is None and r.finish == "length"]
        garbled = sum(results[i].text != expected[i] for i in finished)
        figures = {
            "test": "streams through a Redis crash",
            "persistent": persistent,
            "outage_s": round(back - killed, 2),
            "sent": STREAMS,
            "in_flight_at_crash": in_flight,
            "completed": len(finished) - garbled,
            "errored": errored,
            "garbled": garbled,
            "hung": hung,
            "recovery_s": round(recovered, 2),
        }
        print(json.dumps(figures))
        assert hung == 0 and errored == 0 and garbled == 0, (figures, [asdict(r) for r in results])
        assert len(finished) == STREAMS, figures
        assert in_flight == STREAMS, "streams ended before the crash: the test proves nothing"
        assert recovered < 10, figures


@pytest.mark.parametrize("persistent", [True, False], ids=["aof", "no-persistence"])
def test_queued_requests_are_served_if_redis_kept_them_else_fail_at_once(
    shared: Shared, answers: dict[tuple[int, int], str], persistent: bool
) -> None:
    """Every worker is stopped (SIGSTOP), so requests wait unread in their queues when Redis crashes."""
    with outage_stack(shared, persistent) as (stack, server):
        expected = references(stack.url, 3, answers, QUEUED_TOKENS)
        pids = [stack.workers[w].pid for w in WORKERS]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        # A read a worker had blocked in Redis before it stopped could still take a request (the server
        # answers it into the socket): let it time out first (BLOCK 100 ms); the heartbeat lives 3 s.
        time.sleep(0.3)
        try:
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                queued = [body(i, max_tokens=QUEUED_TOKENS) for i in range(3)]
                replies = [pool.submit(complete, stack.url, b, 120) for b in queued]
                r = server.client()
                queues = [contracts.queue("tiny", w) for w in WORKERS]
                wait_for(lambda: sum(r.xlen(q) for q in queues) == 3, 3, "three queued requests")
                r.close()
                if persistent:
                    time.sleep(1.1)  # an AOF is written at least every second
                server.kill()
                server.start()
                back = time.monotonic()
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                outcomes = [(f.result(timeout=150), time.monotonic() - back) for f in replies]
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        figures = {
            "test": "queued requests through a Redis crash",
            "persistent": persistent,
            "statuses": [a.status_code for a, _ in outcomes],
            "answered_after_s": [round(t, 2) for _, t in outcomes],
        }
        print(json.dumps(figures))
        for i, (resp, took) in enumerate(outcomes):
            if persistent:  # kept: served, exactly
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == expected[i]
            else:  # lost: a clear error, promptly
                assert resp.status_code == 503, resp.text
                assert resp.json()["error"]["code"] == "queue_unavailable"
                assert resp.headers["retry-after"] == "2"
                assert took < 20, figures
        assert first_success_after(stack.url, time.monotonic()) < 10


def test_a_stack_started_before_redis_serves_once_redis_is_up(zoo: ZooPaths, tmp_path: Path) -> None:
    """Gateway and worker start while Redis is still down (a service manager starts them in any order):
    neither exits; the gateway answers /health and requests with 503 meanwhile; once Redis is up they
    serve with no restart."""
    with redis_process(persistent=False) as server:
        server.kill()
        (tmp_path / "stack").mkdir()
        stack = Stack(zoo, server.url, tmp_path / "stack")
        try:
            stack.start_worker("w1")
            stack.start_gateway()
            wait_for(lambda: _health(stack.url) == 503, 60, "the gateway to answer while Redis is down")
            resp = complete(stack.url, body(0, max_tokens=2), timeout=30)
            assert resp.status_code == 503, resp.text
            assert "retry-after" in resp.headers
            assert stack.gateway is not None and stack.gateway.poll() is None, stack.logs()
            assert all(p.poll() is None for p in stack.workers.values()), stack.logs()
            server.start()
            stack.wait_ready(workers=1)
            assert first_success_after(stack.url, time.monotonic(), limit=30) < 30
        finally:
            if server.proc is None:
                server.start()
            stack.stop()


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None
