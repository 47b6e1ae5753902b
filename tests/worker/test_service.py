"""The worker service against a real Redis: queue in, output events out, ack after the last event,
cancel, resume after a crash, heartbeat, drain. (Redis outages: test_service_outage.py.)

Every worker runs inside `running`, which drains it and joins its thread (bounded) however the test ends.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from loragate import contracts
from loragate.messages import AdapterRecord, OutputEvent, QueuedRequest, WorkerState
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.heartbeat import Heartbeat
from worker.modelzoo.make import ZooPaths
from worker.registry import AdapterRegistry
from worker.service import WorkerService


def prompt(seed: int, n: int = 24) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(8, 8000) for _ in range(n))


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield r
    r.close()


def make_service(
    zoo: ZooPaths,
    r: redis.Redis,
    worker_id: str = "w1",
    heartbeat: Heartbeat | None = None,
    overlap_writes: bool | None = None,
) -> WorkerService:
    """`overlap_writes`: step writes on a thread of their own (None: `worker.service_writes`' rule)."""
    registry = AdapterRegistry(r, "tiny")
    registry.directory = (zoo.root / "adapters" / "tiny", ())  # published as the worker joins
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=256))
    overlap = overlap_writes
    return WorkerService(engine, r, worker_id, "tiny", registry, heartbeat=heartbeat, overlap_writes=overlap)


@contextlib.contextmanager
def running(service: WorkerService, stop_timeout: float = 30.0) -> Iterator[threading.Thread]:
    """Run the worker on a thread; drain it and wait (bounded) for it to stop, whatever happens."""
    thread = threading.Thread(target=service.run, daemon=True, name=f"worker-{service.worker_id}")
    thread.start()
    try:
        yield thread
    finally:
        service.drain()
        thread.join(stop_timeout)
    assert not thread.is_alive(), "the worker did not stop after drain"


@contextlib.contextmanager
def start(zoo: ZooPaths, r: redis.Redis, worker_id: str = "w1") -> Iterator[WorkerService]:
    service = make_service(zoo, r, worker_id)
    with running(service):
        yield service


def enqueue(r: redis.Redis, msg: QueuedRequest, worker_id: str = "w1") -> None:
    r.xadd(contracts.queue(msg.model, worker_id), {"m": msg.to_json()})


def collect(r: redis.Redis, request_id: str, timeout: float = 60.0, model: str = "tiny") -> list[OutputEvent]:
    events: list[OutputEvent] = []
    last = "0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = r.xread({contracts.output(model, request_id): last}, block=200)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                events.append(OutputEvent.from_json(fields[b"e"]))
        if events and events[-1].is_last:
            return events
    raise AssertionError(f"no final event for {request_id}")


def offline(zoo: ZooPaths, req: Request) -> list[int]:
    adapters = {f"tiny:{n}": zoo.adapter("tiny", n) for n in zoo.adapter_names("tiny")}
    return LLMEngine(zoo.base("tiny"), EngineConfig(adapters=adapters)).generate([req])[0].token_ids


def test_requests_stream_out_and_are_acked_after_the_last_event(zoo: ZooPaths, client: redis.Redis) -> None:
    msgs = [
        QueuedRequest(
            f"r{i}",
            "tiny",
            prompt(i),
            SamplingParams(max_tokens=10, ignore_eos=True),
            adapter=["tiny:qv-r8", None, "tiny:all-r64"][i % 3],
        )
        for i in range(5)
    ]
    with start(zoo, client):
        for m in msgs:
            enqueue(client, m)
        for m in msgs:
            events = collect(client, m.request_id)
            tokens = [t for e in events for t in e.token_ids]
            expected = offline(zoo, Request("x", m.prompt_token_ids, m.params, m.adapter))
            assert tokens == expected
            assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 10
            assert events[-1].prompt_tokens == len(m.prompt_token_ids) and events[-1].worker_id == "w1"
        time.sleep(1.2)  # a heartbeat after the last request
        assert client.xpending(contracts.queue("tiny", "w1"), contracts.WORKER_GROUP)["pending"] == 0
        assert client.xlen(contracts.queue("tiny", "w1")) == 0
        state = WorkerState.from_json(client.get(contracts.worker_state("tiny", "w1")))
        assert state.model == "tiny" and state.kv_blocks_total == 256 and not state.draining
        assert "tiny:qv-r8" in state.adapters_device
        assert b"tiny" in client.hkeys(contracts.MODELS)  # the fleet remembers the base model
    assert client.get(contracts.worker_state("tiny", "w1")) is None


def test_bad_adapter_guide_and_deadline_become_error_events(zoo: ZooPaths, client: redis.Redis) -> None:
    bad = AdapterRecord("broken", "tiny", "/nonexistent/adapter")
    client.hset(contracts.ADAPTERS, bad.key, bad.to_json())
    with start(zoo, client):
        enqueue(client, QueuedRequest("bad", "tiny", prompt(1), SamplingParams(), adapter="tiny:broken"))
        enqueue(client, QueuedRequest("nope", "tiny", prompt(1), SamplingParams(), adapter="tiny:missing"))
        enqueue(client, QueuedRequest("late", "tiny", prompt(1), SamplingParams(), deadline=time.time() - 1))
        guide = SamplingParams(guide='{"type":"regex","value":"(ab"}')
        enqueue(client, QueuedRequest("guide", "tiny", prompt(1), guide))
        for rid, status in (("bad", 400), ("nope", 400), ("late", 504), ("guide", 400)):
            [event] = collect(client, rid)
            assert event.error is not None and event.error["status"] == status, rid
        assert "invalid regex guide" in event.error["message"]


def test_cancel_aborts_a_running_request(zoo: ZooPaths, client: redis.Redis) -> None:
    with start(zoo, client):
        long = QueuedRequest("long", "tiny", prompt(2), SamplingParams(max_tokens=1500, ignore_eos=True))
        enqueue(client, long)
        client.xread({contracts.output("tiny", "long"): "0"}, block=30000)  # wait for the first token
        client.publish(contracts.CANCEL, "long")
        events = collect(client, "long")
        assert events[-1].finish_reason == "abort" and len(events) < 1500


def test_restart_resumes_after_tokens_already_streamed(zoo: ZooPaths, client: redis.Redis) -> None:
    msg = QueuedRequest("resume", "tiny", prompt(3), SamplingParams(max_tokens=12, ignore_eos=True))
    expected = offline(zoo, Request("x", msg.prompt_token_ids, msg.params))
    # A previous incarnation of w1 read the entry and streamed 5 tokens, then died before acking.
    client.xgroup_create(contracts.queue("tiny", "w1"), contracts.WORKER_GROUP, id="0", mkstream=True)
    enqueue(client, msg)
    client.xreadgroup(contracts.WORKER_GROUP, "w1", {contracts.queue("tiny", "w1"): ">"}, count=1)
    first = OutputEvent(token_ids=tuple(expected[:5]), text="", prompt_tokens=24, completion_tokens=5)
    client.xadd(contracts.output("tiny", "resume"), {"e": first.to_json()})
    with start(zoo, client):
        events = collect(client, "resume")
    assert [t for e in events for t in e.token_ids] == expected
    assert events[-1].completion_tokens == 12


def test_a_queue_that_vanished_is_made_again_and_serves(zoo: ZooPaths, client: redis.Redis) -> None:
    """Someone deletes the queue stream (its consumer group with it): the worker recreates both instead of
    dying on NOGROUP, and the next request is served."""
    service = make_service(zoo, client)
    with running(service) as thread:
        first = QueuedRequest("v1", "tiny", prompt(1), SamplingParams(max_tokens=3, ignore_eos=True))
        enqueue(client, first)
        assert collect(client, "v1")[-1].finish_reason == "length"
        client.delete(contracts.queue("tiny", "w1"))
        deadline = time.monotonic() + 10
        while not client.exists(contracts.queue("tiny", "w1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive()
        enqueue(client, QueuedRequest("v2", "tiny", prompt(2), SamplingParams(max_tokens=3, ignore_eos=True)))
        assert collect(client, "v2")[-1].finish_reason == "length"


def test_a_worker_stopped_as_it_starts_waits_for_the_grammar_load(zoo: ZooPaths, client: redis.Redis) -> None:
    """The structured-output engine loads on a daemon thread as the worker starts; a stop must not return
    (and the process exit) while that load is still in xgrammar's native code, where interpreter exit
    would unwind the thread inside C++ and abort the process (seen: SIGHUP 0.3 s after start, exit -6)."""
    service = make_service(zoo, client)
    grammar, load = service.engine.grammar, service.engine.grammar.warm

    def slow_load() -> None:
        time.sleep(1.0)  # a loaded machine: the stop arrives while the load is under way
        load()

    grammar.warm = slow_load  # type: ignore[method-assign]
    service.drain()  # stopped before its loop ever ran
    started = time.monotonic()
    service.run()
    assert grammar.is_warm, "run() returned while the grammar load was still going"
    assert time.monotonic() - started >= 1.0
