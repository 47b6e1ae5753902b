"""Fleet behaviour on the real stack: client disconnect frees the worker, SIGTERM drains, several gateways
share one Redis, and a full fleet answers 429 with Retry-After."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import redis

from loragate import contracts
from loragate.messages import OutputEvent
from tests.e2e.outputs import stored_output
from tests.e2e.stack import ADMIN_TOKEN, Stack

KEY = {"Authorization": "Bearer sk-test-alice"}
# No queue-wait bound (gateway/admission): on a loaded machine the decode-rate estimate falls and a request
# was refused at once (429, "estimated wait 113 s") where these tests drain, re-route and bound queues by
# policy; the wait bound has its own tests (tests/e2e/test_overload.py).
STACK_GATEWAY_CONFIG = {"admission_wait_bound_s": 0}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LONG = {
    "model": "tiny",
    "prompt": "while True:",
    "max_tokens": 1500,
    "temperature": 0,
    "stream": True,
    "ignore_eos": True,
}


def outstanding(url: str) -> int:
    workers = httpx.get(f"{url}/admin/workers", headers=ADMIN, timeout=5).json()["workers"]
    return sum(w["queue_len"] for w in workers)


def aborted_after(stack: Stack, request_id: str, timeout: float = 15.0) -> int:
    """Wait for the request's last output event; it must be an abort: returns the tokens it had made."""
    r = redis.Redis.from_url(stack.redis_url, socket_timeout=10, socket_connect_timeout=10)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            entries = r.xrange(
                contracts.output("tiny", contracts.scoped_request_id("alice", request_id))
            )  # KEY is alice's
            last = OutputEvent.from_json(entries[-1][1][b"e"]) if entries else None
            if last is not None and last.is_last:
                assert last.finish_reason == "abort"
                return last.completion_tokens
            time.sleep(0.1)
    finally:
        r.close()
    raise AssertionError(f"request {request_id} did not end within {timeout} s")


def test_client_disconnect_cancels_the_request_on_the_worker(stack: Stack) -> None:
    stack.wait_idle()
    headers = {**KEY, "X-Request-Id": f"disconnect-stream-{time.time_ns()}"}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=LONG, headers=headers, timeout=60) as resp:
        lines = resp.iter_lines()
        seen = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data: ") for line in seen)
    assert aborted_after(stack, headers["X-Request-Id"]) < LONG["max_tokens"]
    stack.wait_idle()


def test_a_non_streaming_client_that_gives_up_cancels_its_request(stack: Stack) -> None:
    stack.wait_idle()
    headers = {**KEY, "X-Request-Id": f"disconnect-whole-{time.time_ns()}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/completions", json={**LONG, "stream": False}, headers=headers, timeout=1)
    assert aborted_after(stack, headers["X-Request-Id"]) < LONG["max_tokens"]
    stack.wait_idle()


@dataclass
class Progress:
    """What one streamed request has shown so far (written by its thread, read by the test)."""

    worker: str | None = None
    chunks: int = 0  # text chunks received
    status: int = 0  # the response's status
    error: str = ""  # its body, when it is no stream (a failure says why)


def _stream(
    url: str, max_tokens: int = 60, request_id: str | None = None, progress: Progress | None = None
) -> tuple[str | None, int]:
    """(finish reason, completion tokens from the usage chunk) of one streamed request."""
    body = {
        **LONG,
        "max_tokens": max_tokens,
        "prompt": "for i in range(10):",
        "stream_options": {"include_usage": True},
    }
    headers = {**KEY, "X-Request-Id": request_id} if request_id else KEY
    progress = progress or Progress()
    finish, tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as resp:
        progress.worker = resp.headers.get("x-loragate-worker")
        progress.status = resp.status_code
        if resp.status_code != 200:
            progress.error = resp.read().decode(errors="replace")[:500]
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    finish = chunk["choices"][0]["finish_reason"] or finish
                    progress.chunks += 1
                else:
                    tokens = chunk["usage"]["completion_tokens"]
    return finish, tokens


def test_sigterm_drains_a_worker_without_losing_requests(stack: Stack) -> None:
    """SIGTERM lands while the worker is generating: its running request still finishes, on it, in full;
    requests sent while it drains go to the others. Nothing is lost."""
    stack.start_worker("w3")
    stack.wait_ready(workers=3)
    stack.wait_idle()
    max_tokens = 150
    proc: subprocess.Popen[bytes] | None = None
    try:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:

            def submit() -> tuple[str, Progress, concurrent.futures.Future[tuple[str | None, int]]]:
                """A stream, once its first token is in (the routing header comes with it)."""
                rid, progress = f"drain-{time.time_ns()}", Progress()
                future = pool.submit(_stream, stack.url, max_tokens, rid, progress)
                deadline = time.monotonic() + 30
                while progress.worker is None:
                    assert time.monotonic() < deadline and not future.done(), (
                        progress.status,
                        progress.error,
                    )
                    time.sleep(0.01)
                return rid, progress, future

            before = [submit()]  # one stream at a time, until one is generating on w3
            while before[-1][1].worker != "w3":
                assert len(before) < 8, [p.worker for _, p, _ in before]
                before.append(submit())
            proc = stack.workers.pop("w3")
            made_before = stored_output(stack.redis_url, before[-1][0])[-1][1].completion_tokens
            proc.send_signal(signal.SIGTERM)
            after = [submit() for _ in range(2)]
            results = [f.result(timeout=120) for _, _, f in before + after]
        assert proc.wait(timeout=60) == 0  # it finished its work and exited cleanly
    finally:  # a failed assertion must not leave w3 running (or unreaped) for the next test
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
    assert all(finish == "length" and tokens == max_tokens for finish, tokens in results), results
    assert all(p.worker != "w3" for _, p, _ in after)  # a draining worker takes nothing new
    entries = stored_output(stack.redis_url, before[-1][0])
    # w3 had made only a few tokens just before SIGTERM, and made the rest after it.
    assert 0 < made_before < max_tokens // 2 and entries[-1][1].completion_tokens == max_tokens
    assert {e.worker_id for _, e in entries} == {"w3"}  # all by the draining worker, not redone elsewhere


def test_a_policy_put_reaches_a_second_gateway_and_bounds_queues_with_429(stack: Stack) -> None:
    stack.wait_idle()
    proc, url = stack.extra_gateway()  # another gateway process on the same Redis
    original = httpx.get(f"{stack.url}/admin/policy", headers=ADMIN).json()
    try:
        doc = json.loads(json.dumps(original["document"]))
        for plugin in doc["plugins"]:
            if plugin["type"] == "queue-bound":
                plugin["parameters"] = {**plugin.get("parameters", {}), "max_outstanding": 1}
        put = httpx.put(f"{stack.url}/admin/policy", json=doc, headers=ADMIN)
        assert put.status_code == 201
        time.sleep(1.2)  # every gateway applies a new policy within a second
        assert httpx.get(f"{url}/admin/policy", headers=ADMIN).json()["version"] == put.json()["version"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # one outstanding request per worker, long enough to still be running when the third comes
            busy = [pool.submit(_stream, url, 600) for _ in range(2)]
            deadline = time.monotonic() + 10
            while outstanding(url) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = httpx.post(f"{url}/v1/completions", json={**LONG, "stream": False}, headers=KEY)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert all(f.result(timeout=120)[0] == "length" for f in busy)
    finally:
        back = httpx.post(
            f"{stack.url}/admin/policy/rollback", json={"version": original["version"] or 0}, headers=ADMIN
        )
        if back.status_code == 404:  # the default policy was never stored: store it again
            httpx.put(f"{stack.url}/admin/policy", json=original["document"], headers=ADMIN)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    time.sleep(1.2)
    ok = httpx.post(
        f"{stack.url}/v1/completions",
        json={**LONG, "max_tokens": 3, "stream": False},
        headers=KEY,
        timeout=60,
    )
    assert ok.status_code == 200


def test_ended_requests_free_admission_room_before_the_next_fleet_refresh(stack: Stack) -> None:
    """Fair admission holds requests back only while workers are busy: with room for one outstanding
    request per worker, back-to-back short requests never wait, because each one that ends is uncounted at
    once (not only at the next fleet refresh, half a second later, which would stall every third one).
    The positive control: twice as many concurrent requests as there is room for, and the extra ones wait."""
    stack.wait_idle()
    proc, url = stack.extra_gateway(fair_admission_per_worker=1)
    try:
        body = {"model": "tiny", "prompt": "for i in range(3):", "max_tokens": 2, "temperature": 0}
        with httpx.Client(headers=KEY, timeout=60) as client:
            for _ in range(12):
                assert client.post(f"{url}/v1/completions", json=body).status_code == 200
        stats = httpx.get(f"{url}/admin/policy/stats", headers=ADMIN, timeout=10).json()
        assert stats["admission_waited"] == 0
        workers = len(httpx.get(f"{url}/admin/workers", headers=ADMIN, timeout=10).json()["workers"])
        start = threading.Barrier(2 * workers)  # all of them sent at once, long enough to overlap on any host

        def busy_stream() -> tuple[str | None, int]:
            start.wait(timeout=30)
            return _stream(url, 64)

        with concurrent.futures.ThreadPoolExecutor(2 * workers) as pool:
            busy = [pool.submit(busy_stream) for _ in range(2 * workers)]
            assert all(f.result(timeout=120) == ("length", 64) for f in busy)
        stats = httpx.get(f"{url}/admin/policy/stats", headers=ADMIN, timeout=10).json()
        assert stats["admission_waited"] >= workers  # the ones beyond the room held back, then served
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_client_that_leaves_while_waiting_for_its_fair_turn_is_never_queued(stack: Stack) -> None:
    """With room for one outstanding request per worker and every worker busy, a new request waits in the
    gateway's fair queue; its client gives up there. When room frees, the request is dropped before it is
    queued: no worker ever reads it (no request record, no output stream), and the busy ones finish."""
    stack.wait_idle()
    # No wait bound: under a loaded machine the estimated wait could refuse the request at once (429),
    # and this test is about the fair queue, not the overload check.
    proc, url = stack.extra_gateway(fair_admission_per_worker=1, admission_wait_bound_s=0)
    r = redis.Redis.from_url(stack.redis_url, socket_timeout=10, socket_connect_timeout=10)
    try:

        def idle_workers() -> list[str]:  # tiny workers this gateway still sees room on
            listed = httpx.get(f"{url}/admin/workers", headers=ADMIN, timeout=10).json()["workers"]
            return [
                w["worker_id"]
                for w in listed
                if w["model"] == "tiny" and not w["draining"] and w["queue_len"] < 1
            ]

        workers = len(idle_workers())
        with concurrent.futures.ThreadPoolExecutor(3 * workers) as pool:
            busy: list[concurrent.futures.Future[tuple[str | None, int]]] = []

            def occupy(n: int) -> None:  # n more long streams, each streaming before this returns
                started = [Progress() for _ in range(n)]
                busy.extend(pool.submit(_stream, url, 400, None, p) for p in started)
                while not all(p.chunks for p in started):
                    assert not any(f.done() for f in busy), [f.result() for f in busy if f.done()]
                    time.sleep(0.02)

            occupy(workers)
            # Prefix affinity may put two of them on one worker: fill until every worker holds one, as
            # this gateway sees it (its fleet view refreshes every half second), so no room is left.
            deadline = time.monotonic() + 30
            while idle := idle_workers():
                assert len(busy) < 3 * workers and time.monotonic() < deadline, idle
                time.sleep(0.6)
                if idle_workers():
                    occupy(1)
            before = httpx.get(f"{url}/admin/policy/stats", headers=ADMIN, timeout=10).json()
            body = {"model": "tiny", "prompt": "import os", "max_tokens": 8, "temperature": 0}
            rid = f"left-in-fair-queue-{time.time_ns()}"
            try:
                answer = httpx.post(
                    f"{url}/v1/completions",
                    json=body,
                    headers={**KEY, "X-Request-Id": rid},
                    timeout=httpx.Timeout(10, read=0.5),
                )
            except httpx.ReadTimeout:
                pass
            else:
                pytest.fail(f"answered while every worker was busy: {answer.status_code} {answer.text}")
            assert not any(f.done() for f in busy)  # it left while still waiting for room
            after = httpx.get(f"{url}/admin/policy/stats", headers=ADMIN, timeout=10).json()
            assert after["admission_waited"] > before["admission_waited"]  # it really waited its turn
            assert all(f.result(timeout=120) == ("length", 400) for f in busy)
        stack.wait_idle()
        qid = contracts.scoped_request_id("alice", rid)
        assert not r.exists(contracts.request_record("tiny", qid)), "the departed request was queued"
        assert not r.exists(contracts.output("tiny", qid)), "a worker ran (or aborted) the departed request"
    finally:
        r.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
