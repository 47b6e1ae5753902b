"""Metric values after a known sequence of requests, from the gateway's /metrics and a worker's port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import Stack, free_port
from worker.modelzoo.make import ZooPaths

KEY = {"Authorization": "Bearer sk-test-alice"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def observed(
    zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, int]]:
    client = redis.Redis.from_url(redis_server, socket_timeout=10, socket_connect_timeout=10)
    client.flushall()
    client.close()
    stack = Stack(zoo, redis_server, Path(tmp_path_factory.mktemp("obs")))
    port = free_port()
    try:
        stack.start_worker("m1", metrics_port=port)
        stack.start_gateway()
        stack.wait_ready(workers=1)
        yield stack, port
    finally:
        stack.stop()


def test_metrics_after_a_known_sequence(observed: tuple[Stack, int]) -> None:
    stack, worker_port = observed
    body = {
        "model": "tiny:qv-r8",
        # Several KV blocks long, so the second and third identical prompts hit the prefix cache.
        "prompt": "print('hi')\n" * 12,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    usages = []
    for _ in range(3):
        resp = httpx.post(f"{stack.url}/v1/completions", json=body, headers=KEY, timeout=60)
        assert resp.status_code == 200, resp.text
        usages.append(resp.json()["usage"])
    prompt_tokens = usages[0]["prompt_tokens"]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert prompt_tokens > 32 and cached[0] == 0 and cached[1] == cached[2] > 0, usages
    assert (
        httpx.post(
            f"{stack.url}/v1/completions", json={**body, "model": "nope"}, headers=KEY, timeout=10
        ).status_code
        == 404
    )
    m = samples(httpx.get(f"{stack.url}/metrics", timeout=10).text)
    ok = ("loragate_requests_total", (("adapter", "tiny:qv-r8"), ("model", "tiny"), ("status", "200")))
    assert m[ok] == 3
    assert m[("loragate_requests_total", (("adapter", "none"), ("model", "unknown"), ("status", "404")))] == 1
    assert m[("loragate_ttft_seconds_count", (("model", "tiny"),))] == 3
    assert m[("loragate_completion_tokens_total", (("model", "tiny"),))] == 12
    assert m[("loragate_routing_decisions_total", (("outcome", "single"),))] == 3
    assert m[("loragate_prompt_tokens_total", (("kind", "cached"),))] == sum(cached)
    assert m[("loragate_prompt_tokens_total", (("kind", "computed"),))] == 3 * prompt_tokens - sum(cached)
    assert ("loragate_worker_queue_depth", (("model", "tiny"), ("worker", "m1"))) in m
    assert m[("loragate_worker_kv_blocks", (("state", "free"), ("worker", "m1")))] > 0

    w = samples(httpx.get(f"http://127.0.0.1:{worker_port}/metrics", timeout=10).text)
    assert w[("loragate_engine_generated_tokens_total", (("worker", "m1"),))] == 12
    assert w[("loragate_engine_adapter_loads_total", (("tier", "disk"), ("worker", "m1")))] == 1
    # The worker counts the same prefix-cache hits the gateway reported, out of every prompt token.
    assert w[("loragate_engine_prefix_tokens_total", (("kind", "hit"), ("worker", "m1")))] == sum(cached)
    assert w[("loragate_engine_prefix_tokens_total", (("kind", "queried"), ("worker", "m1")))] == (
        3 * prompt_tokens
    )
