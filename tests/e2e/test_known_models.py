"""A base model the fleet served, with no live worker now, is 503 with Retry-After (a worker may be
restarting, or Redis just came back); only a name never served is 404 — on the gateway that saw the model,
and on a gateway started afterwards (which learns it from `lg:models`)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.stack import Stack, free_port
from tests.redis_process import redis_process
from worker.modelzoo.make import ZooPaths

KEY = {"Authorization": "Bearer sk-test-alice"}


def ask(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=KEY, timeout=30)


def assert_no_worker(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "2"
    assert resp.json()["error"]["code"] == "no_worker"


def assert_unknown(resp: httpx.Response) -> None:
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["code"] == "model_not_found"
    assert resp.json()["error"]["param"] == "model"


def test_a_known_model_without_workers_is_503_and_an_unknown_one_404(zoo: ZooPaths, tmp_path: Path) -> None:
    with redis_process(persistent=False) as server:
        stack = Stack(zoo, server.url, tmp_path)
        late: subprocess.Popen[bytes] | None = None
        try:
            stack.start_worker("w1")
            stack.start_gateway()
            stack.wait_ready(workers=1)
            assert ask(stack.url, "tiny").status_code == 200
            assert_unknown(ask(stack.url, "no-such-model"))
            stack.kill_worker("w1")
            deadline = time.monotonic() + 30
            health = f"{stack.url}/health"
            while httpx.get(health, timeout=5).json()["workers"] and time.monotonic() < deadline:
                time.sleep(0.2)  # until its heartbeat expires
            assert_no_worker(ask(stack.url, "tiny"))
            assert_unknown(ask(stack.url, "no-such-model"))
            # A gateway that never saw a live `tiny` worker knows it from the fleet's memory in Redis.
            port = free_port()
            with (tmp_path / "late-gateway.log").open("ab") as log:
                command = ["gateway", "--port", str(port), "--config", str(stack.config)]
                late = subprocess.Popen(
                    [sys.executable, "-m", "loragate.cli", *command],
                    env=stack.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 503:  # up, and no worker
                        break
                time.sleep(0.2)
            assert_no_worker(ask(url, "tiny"))
            assert_unknown(ask(url, "no-such-model"))
        finally:
            if late is not None:
                late.terminate()
                try:
                    late.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    late.kill()
                    late.wait()
            stack.stop()
