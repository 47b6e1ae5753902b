"""Guides compiled off the worker's step thread (`worker.service_compiles`), against a real Redis and the tiny
zoo model: a compile held open (`Gated`, the service's `compile_fn`) stops no running sequence, and the
request starts once it ends; a guide that does not compile still answers 400 first; a cancel, a drain, a
re-sync and a full intake each meet a request whose guide is still compiling; a guide compiled before
starts at once; and the engine adds a request with a grammar compiled on another thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from loragate import contracts
from loragate.guides import Guide, GuideKind
from loragate.messages import QueuedRequest
from loragate.redis_url import connect_sync
from loragate.types import Request, SamplingParams
from tests.redis_process import redis_process
from tests.waiting import wait_for
from tests.worker.test_service import collect, enqueue, prompt, running
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.engine_requests import unstarted_abort
from worker.modelzoo.make import ZooPaths
from worker.registry import AdapterRegistry
from worker.service import WorkerService

CHOICES = ["alpha", "beta", "gamma"]
CHOICE = Guide(GuideKind.CHOICE, CHOICES).to_json()


class Gated:
    """The engine's compile, held until `gate` is set; records the guides it was asked for."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.gate = threading.Event()
        self.calls: list[str] = []

    def __call__(self, params: SamplingParams) -> Any:
        self.calls.append(params.guide)
        assert self.gate.wait(60), "the test never opened the gate"
        return self.engine.grammar.compile(params)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield r
    r.close()


def gated_service(
    zoo: ZooPaths, r: redis.Redis, max_waiting: int = 8, **config: Any
) -> tuple[WorkerService, Gated]:
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=256, **config))
    gated = Gated(engine)
    registry = AdapterRegistry(r, "tiny")
    return WorkerService(engine, r, "w1", "tiny", registry, max_waiting, compile_fn=gated), gated


def guided(rid: str, seed: int, guide: str = CHOICE) -> QueuedRequest:
    return QueuedRequest(rid, "tiny", prompt(seed), SamplingParams(max_tokens=20, seed=seed, guide=guide))


def pending(r: redis.Redis) -> int:
    return int(r.xpending(contracts.queue("tiny", "w1"), contracts.WORKER_GROUP)["pending"])


def test_a_slow_compile_stops_no_running_sequence(zoo: ZooPaths, client: redis.Redis) -> None:
    service, gated = gated_service(zoo, client)
    engine = service.engine
    with running(service):
        enqueue(
            client, QueuedRequest("long", "tiny", prompt(1), SamplingParams(max_tokens=1500, ignore_eos=True))
        )
        client.xread({contracts.output("tiny", "long"): "0"}, block=30000)  # its first token
        enqueue(client, guided("g", 2))
        wait_for(lambda: "g" in service.intake.compiles, "the compile")
        steps, events = engine.last_snapshot.steps, client.xlen(contracts.output("tiny", "long"))
        time.sleep(1.0)  # the compile holds on; on the step thread it would hold every sequence
        assert engine.last_snapshot.steps >= steps + 5
        assert client.xlen(contracts.output("tiny", "long")) >= events + 5
        assert "g" in service.intake.compiles and "g" not in engine.requests
        gated.gate.set()
        done = collect(client, "g")
        assert done[0].error is None and "".join(e.text for e in done) in CHOICES
        assert done[-1].finish_reason == "stop"
        client.publish(contracts.CANCEL, "long")
        assert collect(client, "long")[-1].finish_reason == "abort"
    assert gated.calls == [CHOICE]


def test_a_guide_that_does_not_compile_answers_400_first(zoo: ZooPaths, client: redis.Redis) -> None:
    service, gated = gated_service(zoo, client)
    with running(service):
        enqueue(client, guided("bad", 1, Guide(GuideKind.REGEX, "(ab").to_json()))
        wait_for(lambda: "bad" in service.intake.compiles, "the compile")
        gated.gate.set()
        [event] = collect(client, "bad")
        assert event.error is not None and event.error["status"] == 400
        assert event.error["message"].startswith("invalid regex guide")
        wait_for(lambda: "bad" not in service.active and pending(client) == 0, "the ack")
        assert "bad" not in service.intake.compiles


def test_a_cancel_during_the_compile_aborts_the_request_before_it_starts(
    zoo: ZooPaths, client: redis.Redis
) -> None:
    service, gated = gated_service(zoo, client)
    msg = guided("c", 3)
    with running(service):
        enqueue(client, msg)
        wait_for(lambda: "c" in service.intake.compiles, "the compile")
        client.publish(contracts.CANCEL, "c")
        [event] = collect(client, "c")
        assert event.finish_reason == "abort" and event.token_ids == () and event.completion_tokens == 0
        assert event.prompt_tokens == len(msg.prompt_token_ids) and event.error is None
        wait_for(lambda: pending(client) == 0, "the ack")
        gated.gate.set()  # the compile ends after the cancel: the request must not start now
        time.sleep(0.5)
        assert client.xlen(contracts.output("tiny", "c")) == 1
        assert "c" not in service.engine.requests and service.engine.last_snapshot.steps == 0


def test_a_drain_waits_for_a_compile_then_runs_the_request(zoo: ZooPaths, client: redis.Redis) -> None:
    service, gated = gated_service(zoo, client)
    with running(service) as thread:
        enqueue(client, guided("d", 4))
        wait_for(lambda: "d" in service.intake.compiles, "the compile")
        service.drain()
        time.sleep(0.5)
        assert thread.is_alive(), "the drain ended with a request still compiling"
        gated.gate.set()
        thread.join(30)
        assert not thread.is_alive()
    events = collect(client, "d", timeout=1)
    assert "".join(e.text for e in events) in CHOICES and events[-1].finish_reason == "stop"
    assert pending(client) == 0


def test_a_resync_during_the_compile_starts_the_request_once(zoo: ZooPaths, redis_url: str) -> None:
    """The re-sync after an outage reads this worker's pending entries again, the compiling one with them:
    it is already held, so it neither compiles twice nor starts twice."""
    r = connect_sync(redis_url, socket_timeout=0.3)
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    service, gated = gated_service(zoo, r)
    msg = guided("once", 5)
    with running(service):
        enqueue(client, msg)
        wait_for(lambda: "once" in service.intake.compiles, "the compile")
        outages = service.outages
        client.client_pause(1000)  # the worker's next read times out: it re-syncs when Redis answers
        wait_for(lambda: service.outages > outages, "the re-sync")
        gated.gate.set()
        events = collect(client, "once")
    assert [e.error for e in events] == [None] * len(events) and events[-1].finish_reason == "stop"
    expected = (
        LLMEngine(zoo.base("tiny")).generate([Request("x", msg.prompt_token_ids, msg.params)])[0].token_ids
    )
    assert [t for e in events for t in e.token_ids] == expected
    assert gated.calls == [CHOICE] and pending(client) == 0
    r.close()
    client.close()


def test_requests_compiling_count_against_the_room_for_new_reads(zoo: ZooPaths, client: redis.Redis) -> None:
    service, gated = gated_service(zoo, client, max_waiting=1)
    second = Guide(GuideKind.CHOICE, ["yes", "no"]).to_json()
    with running(service):
        enqueue(client, guided("first", 6))
        enqueue(client, guided("second", 7, second))
        wait_for(lambda: "first" in service.intake.compiles, "the compile")
        time.sleep(0.5)  # the worker polls its queue meanwhile
        assert service.intake.room() == 0 and pending(client) == 1  # the second one waits in Redis
        gated.gate.set()
        assert collect(client, "first")[-1].finish_reason == "stop"
        assert collect(client, "second")[-1].finish_reason == "stop"
    assert gated.calls == [CHOICE, second]


def test_a_guide_compiled_before_starts_at_once_without_the_compile_threads(
    zoo: ZooPaths, client: redis.Redis
) -> None:
    service, gated = gated_service(zoo, client)
    service.engine.grammar.compile(SamplingParams(guide=CHOICE))
    unguided = QueuedRequest("plain", "tiny", prompt(9), SamplingParams(max_tokens=4))
    with running(service):  # the gate stays shut: only a request that skips the pool can finish
        enqueue(client, guided("hit", 8))
        enqueue(client, unguided)
        assert "".join(e.text for e in collect(client, "hit")) in CHOICES
        assert collect(client, "plain")[-1].completion_tokens == 4
    assert gated.calls == []


def test_the_engine_adds_a_request_with_a_grammar_compiled_on_another_thread(zoo: ZooPaths) -> None:
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=256))
    params = [SamplingParams(max_tokens=20, seed=i, guide=g) for i, g in enumerate([CHOICE, CHOICE, ""])]
    with ThreadPoolExecutor(2) as pool:
        grammars = list(pool.map(engine.grammar.compile, params))
    assert grammars[2] is None and engine.grammar.is_compiled(params[0])
    assert engine.grammar.compile(params[0]) is engine.grammar.cache.get(CHOICE)
    for i, (p, g) in enumerate(zip(params, grammars, strict=True)):
        engine.add_request(Request(f"t{i}", prompt(i), p), g)
    outputs: dict[str, str] = {}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = outputs.get(out.request_id, "") + out.text_delta
    assert outputs["t0"] in CHOICES and outputs["t1"] in CHOICES


def test_an_unstarted_abort_reports_what_the_engine_reports_for_an_abort_before_any_step(
    zoo: ZooPaths,
) -> None:
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=256))
    request = Request("a", prompt(1), SamplingParams(max_tokens=8), resume_token_ids=(5, 6))
    engine.add_request(request)
    engine.abort("a")
    [out] = engine.step()
    assert unstarted_abort(request) == out


def test_a_drain_while_redis_is_down_leaves_a_compiling_request_pending(zoo: ZooPaths) -> None:
    """Stopping at once (a drain during an outage) must not lose a request still compiling: its entry stays
    pending on the worker, unacknowledged, for a reaper to re-route."""
    with redis_process(persistent=True) as server:
        client = server.client()
        service, gated = gated_service(zoo, connect_sync(server.url))
        thread = threading.Thread(target=service.run, daemon=True)
        thread.start()
        try:
            enqueue(client, guided("kept", 1))
            wait_for(lambda: "kept" in service.intake.compiles, "the compile")
            # The crash must not take the entry with it: with `appendfsync everysec` Redis may hold the
            # last second's writes in memory, so crash only once the read (an XCLAIM) is in the file.
            log = server.dir / "appendonly.aof"
            wait_for(lambda: log.exists() and b"XCLAIM" in log.read_bytes(), "the read entry in the AOF")
            server.kill()
            time.sleep(0.5)  # the worker is in its outage loop now
            service.drain()
            thread.join(10)
            assert not thread.is_alive(), "the worker ignored the drain while Redis was down"
            server.start()
            client = server.client()
            assert pending(client) == 1 and client.xlen(contracts.output("tiny", "kept")) == 0
        finally:
            gated.gate.set()
            service.drain()
            thread.join(30)
            client.close()
