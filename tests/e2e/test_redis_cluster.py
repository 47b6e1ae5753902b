"""loragate unchanged on a real Redis Cluster (issue 16): three masters on loopback ports, started by the
test (`tests.redis_cluster`), a gateway and workers of two base models with `REDIS_URL=redis+cluster://…`.

Each base model's keys share one hash tag, so one model's traffic lives in one slot and two models can
live on two shards. Through the cluster: requests are queued and relayed, streamed and whole, token-exact
with the offline engine; a model's request keys sit on the node that owns its tag and nowhere else;
killing the worker that streams a request makes the gateway's reaper re-route it to the other worker, and
every stream completes token-exact; a client that leaves cancels its request (pub/sub over the cluster).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from redis.cluster import key_slot

from loragate import contracts
from loragate.messages import OutputEvent
from loragate.redis_url import connect_sync
from tests.e2e.stack import ADMIN_TOKEN, Stack
from tests.e2e.test_openai_api import _stream_text, expected_texts
from tests.redis_cluster import RedisCluster3, redis_cluster
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

KEY = {"Authorization": "Bearer sk-test-alice"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _other_shard_name(cluster: RedisCluster3, model: str) -> str:
    """A name for the second model whose slot another master owns (the tag decides the shard)."""
    home = cluster.node_of(contracts.model_queue(model))
    for i in range(1000):
        name = f"{model}-{i}"
        if cluster.node_of(contracts.model_queue(name)) != home:
            return name
    raise AssertionError("every name hashed to one node")


class ClusterStack(Stack):
    def start_alias(self, worker_id: str, name: str, base: str = "tiny") -> None:
        """A worker serving `base`'s checkpoint under another model name."""
        self.workers[worker_id] = self._spawn(
            [
                "worker",
                "--model",
                str(self.zoo.base(base)),
                "--model-name",
                name,
                "--worker-id",
                worker_id,
                "--kv-cache-mb",
                "64",
            ],
            f"{worker_id}.log",
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster3]:
    with redis_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def alias(cluster: RedisCluster3) -> str:
    return _other_shard_name(cluster, "tiny")


@pytest.fixture(scope="module")
def stack(
    zoo: ZooPaths, cluster: RedisCluster3, alias: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    s = ClusterStack(zoo, cluster.url, Path(tmp_path_factory.mktemp("cluster")))
    try:
        s.start_worker("w1")
        s.start_worker("w2")
        s.start_alias("a1", alias)
        s.start_gateway()
        s.wait_ready(workers=3, timeout=180)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def offline(zoo: ZooPaths) -> LLMEngine:
    return LLMEngine(zoo.base("tiny"), EngineConfig())


def _keys_on(cluster: RedisCluster3, pattern: str) -> dict[int, list[str]]:
    """Keys matching `pattern`, by the index of the master that holds them."""
    found: dict[int, list[str]] = {}
    for i, url in enumerate(cluster.node_urls):
        node = redis.Redis.from_url(url, socket_timeout=10)
        try:
            keys = [k.decode() for k in node.scan_iter(match=pattern, count=1000)]
        finally:
            node.close()
        if keys:
            found[i] = keys
    return found


@pytest.mark.timeout(300)
def test_requests_of_two_models_run_on_their_own_shards(
    stack: Stack, cluster: RedisCluster3, alias: str, offline: LLMEngine
) -> None:
    prompts = [f"def cluster_{i}(x):\n    return " for i in range(4)]
    want = expected_texts(offline, [(p, None) for p in prompts], 12)
    for model in ("tiny", alias):
        for i, prompt in enumerate(prompts):
            req = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            if i % 2:
                text, finish = _stream_text(stack.url, {**req, "stream": True})
            else:
                resp = httpx.post(f"{stack.url}/v1/completions", json=req, headers=KEY, timeout=120)
                assert resp.status_code == 200, resp.text
                text, finish = resp.json()["choices"][0]["text"], resp.json()["choices"][0]["finish_reason"]
            assert (text, finish) == (want[i], "length"), (model, i)
    homes = {m: cluster.node_of(contracts.model_queue(m)) for m in ("tiny", alias)}
    assert homes["tiny"] != homes[alias]
    for model, home in homes.items():
        tag = contracts.slot_tag(model)
        for kind in ("out", "req"):  # every request's record and output stream: on the model's node only
            placed = _keys_on(cluster, f"lg:{kind}:{tag}:*")
            assert set(placed) == {home} and len(placed[home]) >= len(prompts), (model, kind, placed)
            assert {key_slot(k.encode()) for k in placed[home]} == {
                key_slot(contracts.model_queue(model).encode())
            }


@pytest.mark.timeout(420)
def test_a_killed_workers_streams_are_rerouted_and_complete(
    stack: Stack, offline: LLMEngine, cluster: RedisCluster3
) -> None:
    prompts = [f"# cluster reroute {i}\nfor x in " for i in range(6)]
    want = expected_texts(offline, [(p, None) for p in prompts], 120)
    bodies = [
        {
            "model": "tiny",
            "prompt": p,
            "max_tokens": 120,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        for p in prompts
    ]
    stack.wait_idle()
    first: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(_stream_text, stack.url, b, None, first) for b in bodies]
        deadline = time.monotonic() + 90
        while len(first) < len(bodies):
            done = [f.exception() or f.result() for f in futures if f.done()]
            assert time.monotonic() < deadline and not done, (first, done)
            time.sleep(0.01)
        stack.kill_worker("w1")
        results = [f.result(timeout=300) for f in futures]
    try:
        assert "w1" in first  # some streams had to move
        for (text, finish), expected in zip(results, want, strict=True):
            assert (text, finish) == (expected, "length")
        # The dead worker's queue was emptied and removed from its slot by the reaper.
        client = cluster.client()
        try:
            deadline = time.monotonic() + 30
            while client.exists(contracts.queue("tiny", "w1")) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not client.exists(contracts.queue("tiny", "w1"))
        finally:
            client.close()
    finally:
        stack.start_worker("w1")
        stack.wait_ready(workers=3, timeout=180)


@pytest.mark.timeout(300)
def test_a_client_that_leaves_cancels_its_request_across_the_cluster(stack: Stack) -> None:
    """The cancel goes out on pub/sub, which a cluster forwards to every node: the worker hears it on
    whichever node it subscribed to and aborts the request (its output stream ends with `abort`)."""
    stack.wait_idle()
    rid = f"cluster-leave-{time.monotonic_ns()}"
    req = {"model": "tiny", "prompt": "while True:\n", "max_tokens": 1000, "temperature": 0, "stream": True}
    headers = {**KEY, "X-Request-Id": rid}
    with httpx.stream(
        "POST", f"{stack.url}/v1/completions", json={**req, "ignore_eos": True}, headers=headers, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then leave
    client = connect_sync(stack.redis_url)
    try:
        key = contracts.output("tiny", contracts.scoped_request_id("alice", rid))
        deadline, events = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            events = [OutputEvent.from_json(f[contracts.OUTPUT_FIELD_BYTES]) for _, f in client.xrange(key)]
            if events and events[-1].finish_reason is not None:
                break
            time.sleep(0.1)
        assert events and events[-1].finish_reason == "abort", events[-1:]
        assert max(e.completion_tokens for e in events) < 1000  # cut short, not run to its end
    finally:
        client.close()
