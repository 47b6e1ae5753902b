"""Scale from zero through the model's shared stream (`model_queue_max`): with no worker live, a request
for a known model waits on `lg:mq:{model}` instead of getting 503; the first worker to start takes it
and the client gets its answer. The stream is bounded (429 beyond), and a client that leaves while its
request waits there takes it off the stream (no worker runs it for nobody). Meanwhile the gateway stays
ready (`/ready`) and reports the model's demand for workers (`/admin/models/{model}/demand`)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from loragate import contracts
from loragate.messages import OutputEvent
from tests.e2e.stack import ADMIN_TOKEN, Stack
from tests.redis_process import redis_process
from tests.waiting import wait_for
from worker.modelzoo.make import ZooPaths

KEY = {"Authorization": "Bearer sk-test-alice"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BODY = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 5, "temperature": 0}


def no_workers(stack: Stack) -> bool:
    return bool(httpx.get(f"{stack.url}/health", timeout=5).json()["workers"] == 0)


def demand(stack: Stack) -> dict[str, int]:
    """The model's demand as an autoscaler reads it (`/admin/models/{model}/demand`)."""
    got = httpx.get(f"{stack.url}/admin/models/tiny/demand", headers=ADMIN, timeout=10)
    assert got.status_code == 200, got.text
    return {k: v for k, v in got.json().items() if k != "model"}


@pytest.fixture(scope="module")
def fleet(
    zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, redis.Redis, str]]:
    """The module's stack, with `model_queue_max=2`, whose first worker answered one request (so the fleet
    knows `tiny`): (the stack, a Redis client, that answer's text)."""
    with redis_process(persistent=False) as server:
        r = redis.Redis.from_url(server.url, socket_timeout=10)
        stack = Stack(zoo, server.url, tmp_path_factory.mktemp("model-queue"), model_queue_max=2)
        try:
            stack.start_worker("w1")
            stack.start_gateway()
            stack.wait_ready(workers=1)
            first = httpx.post(f"{stack.url}/v1/completions", json=BODY, headers=KEY, timeout=30)
            assert first.status_code == 200, first.text
            yield stack, r, first.json()["choices"][0]["text"]
        finally:
            stack.stop()
            r.close()


@pytest.fixture
def scaled_to_zero(fleet: tuple[Stack, redis.Redis, str]) -> tuple[Stack, redis.Redis, str]:
    """The module's stack with every worker it has (the first, or an earlier test's) dead and gone from
    the fleet, and nothing on the model's shared stream."""
    stack, r, _ = fleet
    for worker_id in list(stack.workers):
        stack.kill_worker(worker_id)
    wait_for(lambda: no_workers(stack), "the dead workers' heartbeats to lapse")
    assert r.xlen(contracts.model_queue("tiny")) == 0
    return fleet


def test_requests_wait_for_the_first_worker_and_the_stream_is_bounded(
    scaled_to_zero: tuple[Stack, redis.Redis, str],
) -> None:
    shared = contracts.model_queue("tiny")
    stack, r, first_text = scaled_to_zero
    answers: dict[str, httpx.Response] = {}

    def ask(name: str, stream: bool) -> None:
        body = {**BODY, "stream": stream}
        answers[name] = httpx.post(f"{stack.url}/v1/completions", json=body, headers=KEY, timeout=120)

    waiting = [threading.Thread(target=ask, args=(n, n == "b"), daemon=True) for n in ("a", "b")]
    for i, t in enumerate(waiting):
        t.start()
        wait_for(lambda i=i: r.xlen(shared) > i, "the request on the shared stream")
    assert r.xlen(shared) == 2 and not answers  # both wait: no 503
    assert demand(stack) == {"workers": 0, "outstanding": 0, "waiting_for_worker": 2, "demand": 2}
    assert httpx.get(f"{stack.url}/ready", timeout=10).status_code == 200  # in its Service
    full = httpx.post(f"{stack.url}/v1/completions", json=BODY, headers=KEY, timeout=30)
    assert full.status_code == 429, full.text
    assert full.json()["error"]["code"] == "overloaded" and full.headers["retry-after"]

    stack.start_worker("w2")  # the cold start: it takes both from the stream
    for t in waiting:
        t.join(120)
    assert answers["a"].status_code == 200, answers["a"].text
    assert answers["a"].headers["x-loragate-worker"] == "w2"
    assert answers["a"].json()["choices"][0]["text"] == first_text
    assert answers["b"].status_code == 200 and "data: [DONE]" in answers["b"].text
    assert r.xlen(shared) == 0
    wait_for(lambda: demand(stack)["outstanding"] == 0, "the finished requests' acks")
    assert demand(stack) == {"workers": 1, "outstanding": 0, "waiting_for_worker": 0, "demand": 0}


def test_a_client_that_leaves_takes_its_request_off_the_shared_stream(
    scaled_to_zero: tuple[Stack, redis.Redis, str],
) -> None:
    shared = contracts.model_queue("tiny")
    stack, r, _ = scaled_to_zero
    rid = contracts.scoped_request_id("alice", "leaves-1")

    # The client leaves (closes its connection) while its request waits on the stream, unanswered.
    body = json.dumps({**BODY, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {KEY['Authorization']}\r\n"
        f"X-Request-Id: leaves-1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        wait_for(lambda: r.xlen(shared) == 1, "the request on the shared stream")
    wait_for(lambda: r.xlen(shared) == 0, "the cancel to take it off the stream")
    stack.start_worker("w3")
    stack.wait_ready(workers=1)
    time.sleep(1.0)  # a worker that took it would be streaming tokens by now
    events = [OutputEvent.from_json(f[b"e"]) for _, f in r.xrange(contracts.output("tiny", rid))]
    assert [e.finish_reason for e in events] == ["abort"] and not events[0].token_ids
