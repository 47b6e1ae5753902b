"""`/ready` (Redis answers, workers or not) and `/admin/models/{model}/demand` (outstanding requests of a
model, from Redis) on a real gateway and Redis; the demand with live workers is in the e2e scale-from-zero
test (tests/e2e/test_model_queue.py)."""

from __future__ import annotations

import json
import time

import httpx
import redis

from loragate import contracts
from loragate.messages import QueuedRequest
from loragate.types import SamplingParams
from tests.e2e.stack import ADMIN_TOKEN, free_port
from tests.gateway.live_gateway import live_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_ready_while_redis_answers_even_with_no_worker(redis_url: str) -> None:
    with live_gateway(redis_url) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # no worker
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "redis": True}


def test_not_ready_without_redis() -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with live_gateway(nowhere, redis_timeout_s=1.0) as url:
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["redis"] is False


def test_demand_counts_the_shared_stream_and_refuses_unknown_models(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    model = f"cold-{time.monotonic_ns()}"
    seen = {"model_dir": "/m", "max_model_len": 64, "block_size": 16, "at": time.time()}
    r.hset(contracts.MODELS, model, json.dumps(seen))  # served once, no worker now
    msg = QueuedRequest("d1", model, (1, 2, 3), SamplingParams(max_tokens=2))
    for _ in range(3):
        r.xadd(contracts.model_queue(model), {contracts.QUEUE_FIELD: msg.to_json()})
    try:
        with live_gateway(redis_url) as url:
            got = httpx.get(f"{url}/admin/models/{model}/demand", headers=ADMIN, timeout=10)
            assert got.status_code == 200, got.text
            assert got.json() == {
                "model": model,
                "workers": 0,
                "outstanding": 0,
                "waiting_for_worker": 3,
                "demand": 3,
            }
            unknown = httpx.get(f"{url}/admin/models/never-served/demand", headers=ADMIN, timeout=10)
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            anonymous = httpx.get(f"{url}/admin/models/{model}/demand", timeout=10)
            assert anonymous.status_code == 401
    finally:
        r.delete(contracts.model_queue(model))
        r.hdel(contracts.MODELS, model)
        r.close()
