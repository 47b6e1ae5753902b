"""Work stealing against a real Redis: workers take their model's shared stream `lg:mq:{model}` (what no
worker could take when it came) onto their own queues, each entry exactly once, and run it there."""

from __future__ import annotations

import time

import redis

from loragate import contracts
from loragate.messages import QueuedRequest
from loragate.types import Request, SamplingParams
from tests.worker.test_service import client, collect, enqueue, make_service, offline, prompt, running
from worker.modelzoo.make import ZooPaths

__all__ = ["client"]  # the fixture, shared with test_service


def share(r: redis.Redis, msg: QueuedRequest) -> str:
    """Queue `msg` on its model's shared stream with a record pointing at it, as a gateway does."""
    queue = contracts.model_queue(msg.model)
    entry = r.xadd(queue, {contracts.QUEUE_FIELD: msg.to_json()}).decode()
    record = contracts.request_record(msg.model, msg.request_id)
    r.hset(record, mapping={contracts.RECORD_QUEUE: queue, contracts.RECORD_ENTRY: entry})
    return entry


def test_two_workers_take_the_shared_stream_each_entry_once(zoo: ZooPaths, client: redis.Redis) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    msgs = [
        QueuedRequest(f"s{i}", "tiny", prompt(100 + i), params, adapter=[None, "tiny:qv-r8"][i % 2])
        for i in range(8)
    ]
    client.xgroup_create(contracts.model_queue("tiny"), contracts.WORKER_GROUP, id="0", mkstream=True)
    for m in msgs:
        share(client, m)
    w1, w2 = make_service(zoo, client, "w1"), make_service(zoo, client, "w2")
    with running(w1), running(w2):
        ran_on = {}
        for m in msgs:
            events = collect(client, m.request_id)
            tokens = [t for e in events for t in e.token_ids]
            assert tokens == offline(zoo, Request("x", m.prompt_token_ids, m.params, m.adapter))
            assert len(tokens) == 6  # one run each: a second would have written its own events
            ran_on[m.request_id] = worker = events[-1].worker_id
            # The record follows the entry onto the worker's own queue (a retry or a reaper finds it).
            queue = client.hget(contracts.request_record("tiny", m.request_id), contracts.RECORD_QUEUE)
            assert queue == contracts.queue("tiny", worker).encode()
        assert w1.intake.stolen + w2.intake.stolen == len(msgs)
        assert set(ran_on.values()) <= {"w1", "w2"}
        assert client.xlen(contracts.model_queue("tiny")) == 0


def test_a_worker_takes_its_own_queue_and_the_shared_stream_after_it(
    zoo: ZooPaths, client: redis.Redis
) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    own = QueuedRequest("own", "tiny", prompt(1), params)
    shared = QueuedRequest("shared", "tiny", prompt(2), params)
    other = QueuedRequest("other-model", "small", prompt(3), params)
    share(client, other)  # another model's stream: never this worker's
    share(client, shared)
    service = make_service(zoo, client, "w1")
    with running(service):
        enqueue(client, own)
        assert collect(client, "own")[-1].completion_tokens == 4
        assert collect(client, "shared")[-1].worker_id == "w1"
        time.sleep(0.5)
        assert client.xlen(contracts.model_queue("small")) == 1
        assert client.xlen(contracts.model_queue("tiny")) == 0
