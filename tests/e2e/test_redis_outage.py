"""When Redis (the request queues) goes away, the gateway answers 503 with Retry-After, not a 500 and not a
hang."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import httpx
import pytest
import redis

from loragate.embedded_redis import redis_url
from tests.e2e.stack import Stack
from worker.modelzoo.make import ZooPaths

KEY = {"Authorization": "Bearer sk-test-alice"}


@pytest.mark.skipif(bool(os.environ.get("REDIS_URL")), reason="needs a Redis of its own to stop")
def test_a_request_gets_503_when_redis_is_gone(zoo: ZooPaths, tmp_path: Path) -> None:
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
    server = redis_url(tmp_path / "redis")
    url = server.__enter__()
    (tmp_path / "stack").mkdir()
    stack = Stack(zoo, url, tmp_path / "stack")
    try:
        stack.start_worker("w1")
        stack.start_gateway()
        stack.wait_ready(workers=1)
        assert (
            httpx.post(f"{stack.url}/v1/completions", json=body, headers=KEY, timeout=60).status_code == 200
        )
        with contextlib.suppress(redis.ConnectionError):  # the server closes the connection as it goes
            redis.Redis.from_url(url).shutdown(nosave=True)
        time.sleep(0.2)  # gone now; the gateway still has its last view of the fleet, a second old at most
        started = time.monotonic()
        resp = httpx.post(f"{stack.url}/v1/completions", json=body, headers=KEY, timeout=30)
        assert time.monotonic() - started < 10
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "2"
        assert resp.json()["error"]["code"] == "queue_unavailable", stack.logs()
    finally:
        stack.stop()
        with contextlib.suppress(redis.RedisError):  # already shut down
            server.__exit__(None, None, None)
