"""The worker through Redis outages, against a redis-server of the test's own that it crashes and restarts:
running requests lose no output and repeat none (with and without persistence), a worker started before
Redis joins when it comes up, a request re-routed while the worker was away is dropped rather than run
twice, no command reaches a restarted Redis before the worker re-synced, and the heartbeat outlives
engine steps longer than its TTL (but not a silent engine loop)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from gateway.request_store import RequestStore, fingerprint
from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest, WorkerState
from loragate.redis_retry import ServerGuard, server_run_id
from loragate.redis_url import connect_async, connect_sync
from loragate.types import Request, RequestOutput, SamplingParams
from tests.redis_process import RedisProcess, redis_process
from tests.worker.test_service import collect, enqueue, make_service, prompt, running
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.heartbeat import Heartbeat
from worker.ledger import Held, Ledger
from worker.modelzoo.make import ZooPaths
from worker.registry import AdapterRegistry
from worker.service import WorkerService


@pytest.fixture
def aof() -> Iterator[RedisProcess]:
    with redis_process(persistent=True) as server:
        yield server


def references(zoo: ZooPaths, msgs: list[QueuedRequest]) -> dict[str, list[int]]:
    """Each request's tokens from an undisturbed offline run (greedy decoding)."""
    engine = LLMEngine(zoo.base("tiny"), EngineConfig())
    done = engine.generate([Request(m.request_id, m.prompt_token_ids, m.params) for m in msgs])
    return {c.request_id: c.token_ids for c in done}


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# Both ways of sending a step's writes (`worker.service_writes`): from the step loop, and on a thread of
# their own while the next step computes (a write may be in flight when Redis dies).
@pytest.mark.parametrize(
    ("persistent", "overlap_writes"), [(True, False), (False, True)], ids=["aof", "no-persistence-overlapped"]
)
def test_a_redis_crash_mid_generation_loses_no_output_and_repeats_none(
    zoo: ZooPaths, persistent: bool, overlap_writes: bool
) -> None:
    msgs = [
        QueuedRequest(f"crash-{i}", "tiny", prompt(40 + i), SamplingParams(max_tokens=150, ignore_eos=True))
        for i in range(6)
    ]
    expected = references(zoo, msgs)
    with redis_process(persistent) as server:
        client = server.client()
        service = make_service(zoo, connect_sync(server.url), overlap_writes=overlap_writes)
        with running(service) as thread:
            for m in msgs:
                enqueue(client, m)
            wait_for(
                lambda: all(client.xlen(contracts.output("tiny", m.request_id)) >= 3 for m in msgs),
                60,
                "first tokens",
            )
            server.kill()  # a crash, mid-generation
            time.sleep(1.0)
            assert thread.is_alive()  # the worker waits; it does not exit
            server.start()
            client = server.client()
            for m in msgs:
                events = collect(client, m.request_id)
                tokens = [t for e in events for t in e.token_ids]
                assert tokens == expected[m.request_id], m.request_id  # nothing lost, nothing repeated
                assert [e.completion_tokens for e in events] == list(range(1, 151))
                assert events[-1].finish_reason == "length"
            wait_for(lambda: client.xlen(contracts.queue("tiny", "w1")) == 0, 10, "the acks")
            wait_for(lambda: client.exists(contracts.worker_state("tiny", "w1")), 10, "the heartbeat")
            assert service.outages == 1
            # Re-announced: adapters (the registry was lost without persistence) and the consumer group.
            assert client.hexists(contracts.ADAPTERS, "tiny:qv-r8")
            late = QueuedRequest("after", "tiny", prompt(99), SamplingParams(max_tokens=5, ignore_eos=True))
            enqueue(client, late)
            assert collect(client, "after")[-1].completion_tokens == 5


def test_a_worker_started_before_redis_joins_when_it_comes_up(zoo: ZooPaths) -> None:
    server = RedisProcess(persistent=False)
    try:
        service = make_service(zoo, connect_sync(server.url))
        with running(service) as thread:
            time.sleep(1.5)  # Redis is not there: the worker waits, with backoff
            assert thread.is_alive()
            server.start()
            client = server.client()
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            msg = QueuedRequest("late-redis", "tiny", prompt(5), params)
            wait_for(lambda: client.exists(contracts.worker_state("tiny", "w1")), 10, "the heartbeat")
            enqueue(client, msg)
            assert collect(client, "late-redis")[-1].completion_tokens == 4
            assert client.hexists(contracts.ADAPTERS, "tiny:qv-r8")  # the adapter directory was published
    finally:
        server.close()


def test_a_request_reaped_while_the_worker_was_away_is_dropped_and_a_lost_one_queued_again(
    aof: RedisProcess,
) -> None:
    r = aof.client()
    queue = contracts.queue("tiny", "w1")
    r.xgroup_create(queue, contracts.WORKER_GROUP, id="0", mkstream=True)
    msgs = [QueuedRequest(f"q{i}", "tiny", prompt(i), SamplingParams(max_tokens=8)) for i in range(3)]
    for m in msgs:
        r.xadd(queue, {"m": m.to_json()})
    read = r.xreadgroup(contracts.WORKER_GROUP, "w1", {queue: ">"})[0][1]
    ledger = Ledger(r, "w1", "tiny")
    for (entry_id, _), m in zip(read, msgs, strict=True):
        ledger.hold(Held(entry_id.decode(), m))
    # A reaper took q0 over while w1 was out of reach (claimed, re-queued elsewhere, deleted here).
    r.xclaim(queue, contracts.WORKER_GROUP, "reaper", 0, [read[0][0]])
    r.xack(queue, contracts.WORKER_GROUP, read[0][0])
    r.xdel(queue, read[0][0])
    dropped, others = ledger.reclaim(lost=False)
    assert dropped == ["q0"] and others == [] and set(ledger.active) == {"q1", "q2"}
    # Redis lost q1's entry (a restart): it is queued again, already pending on w1, no one else's to read.
    r.xack(queue, contracts.WORKER_GROUP, read[1][0])
    r.xdel(queue, read[1][0])
    stranger = QueuedRequest("new", "tiny", prompt(7), SamplingParams(max_tokens=8))
    r.xadd(queue, {"m": stranger.to_json()})  # queued by a gateway meanwhile
    dropped, others = ledger.reclaim(lost=True)
    assert dropped == [] and [m.request_id for _, m in others] == ["new"]
    pending = r.xpending_range(queue, contracts.WORKER_GROUP, "-", "+", 10, consumername="w1")
    assert {p["message_id"].decode() for p in pending} == {
        ledger.active["q1"].entry_id,
        ledger.active["q2"].entry_id,
        others[0][0],
    }
    r.close()


def test_no_command_reaches_a_restarted_redis_before_the_owner_accepts_it(aof: RedisProcess) -> None:
    r = aof.client()
    guard = ServerGuard()
    guard.install(r, contracts.queue("tiny", "w1"))
    guard.accept(server_run_id(r.info("server")))
    r.set("k", "v")
    aof.restart()
    with pytest.raises(redis.ConnectionError):
        r.get("k")  # redis-py would reconnect silently; the guard refuses the new server
    guard.open()
    guard.accept(server_run_id(r.info("server")))
    assert r.get("k") == b"v"  # from the append-only file
    r.close()


def test_the_heartbeat_outlives_an_engine_step_longer_than_its_ttl(zoo: ZooPaths, aof: RedisProcess) -> None:
    """A step of four 2,000-token prefills on the `small` model (one engine step) takes longer than a
    heartbeat TTL of 0.5 s: the worker must stay alive all through it."""
    r = connect_sync(aof.url)
    ttl = 0.5
    beats = Heartbeat(aof.client(), "w1", "small", interval_s=0.1, ttl_s=ttl)
    engine = LLMEngine(zoo.base("small"), EngineConfig(max_num_batched_tokens=8192, num_kv_blocks=1024))
    service = WorkerService(engine, r, "w1", "small", AdapterRegistry(r, "small"), heartbeat=beats)
    steps: list[float] = []
    step = engine.step

    def timed_step() -> list[RequestOutput]:
        started = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - started)
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    client = aof.client()
    with running(service):
        wait_for(lambda: client.exists(contracts.worker_state("small", "w1")), 10, "the first heartbeat")
        missing = 0
        for i in range(4):
            long_prompt = tuple((7 * j + i) % 4000 + 10 for j in range(2000))
            enqueue(client, QueuedRequest(f"big{i}", "small", long_prompt, SamplingParams(max_tokens=2)))
        done = threading.Event()

        def watch() -> None:
            nonlocal missing
            while not done.is_set():
                missing += not client.exists(contracts.worker_state("small", "w1"))  # the worker looks dead
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            for i in range(4):
                assert collect(client, f"big{i}", timeout=120, model="small")[-1].finish_reason == "length"
        finally:
            done.set()
            watcher.join(5)
    longest = max(steps)
    print(f"longest engine step {longest:.2f} s, heartbeat TTL {ttl} s, {beats.beats} beats")
    assert longest > ttl, f"no step was longer than the TTL ({longest:.2f} s): the test proves nothing"
    assert missing == 0, f"the worker looked dead {missing} times (longest step {longest:.2f} s)"
    client.close()


def test_a_silent_engine_loop_lets_the_heartbeat_lapse(aof: RedisProcess) -> None:
    r = aof.client()
    beats = Heartbeat(r, "w1", "tiny", interval_s=0.05, ttl_s=0.3, stale_after_s=0.4)
    beats.publish(WorkerState("w1", "tiny", "/m", 64))
    beats.start()
    try:
        wait_for(lambda: r.exists(contracts.worker_state("tiny", "w1")), 5, "a heartbeat")
        wait_for(lambda: not r.exists(contracts.worker_state("tiny", "w1")), 5, "the heartbeat to lapse")
        beats.publish(WorkerState("w1", "tiny", "/m", 64))  # the loop is back
        wait_for(lambda: r.exists(contracts.worker_state("tiny", "w1")), 5, "the heartbeat again")
    finally:
        beats.remove()
    assert not r.exists(contracts.worker_state("tiny", "w1"))
    r.close()


def test_missing_events_continue_a_stream_exactly() -> None:
    from worker.ledger import missing_events

    mine = [OutputEvent(token_ids=(t,), completion_tokens=c) for t, c in ((7, 4), (8, 5), (9, 6))]
    final = OutputEvent(finish_reason="abort", completion_tokens=6)
    assert missing_events(None, [*mine, final]) == [*mine, final]  # the stream is gone
    assert missing_events(mine[0], [*mine, final]) == [mine[1], mine[2], final]
    assert missing_events(mine[2], [*mine, final]) == [final]
    assert missing_events(OutputEvent(finish_reason="length", completion_tokens=6), mine) == []


def test_a_drain_while_redis_is_down_stops_the_worker_promptly(zoo: ZooPaths, aof: RedisProcess) -> None:
    """SIGTERM during an outage must not wait for Redis: the worker stops within a few seconds, and its
    running request stays pending in its queue (a reaper re-routes it once the heartbeat lapses)."""
    client = aof.client()
    service = make_service(zoo, connect_sync(aof.url))
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        enqueue(client, QueuedRequest("long", "tiny", prompt(3), params))
        wait_for(lambda: client.xlen(contracts.output("tiny", "long")) >= 3, 60, "first tokens")
        aof.kill()
        time.sleep(0.5)  # the worker is in its outage loop now
        assert thread.is_alive()
        asked = time.monotonic()
        service.drain()
        thread.join(10)
        took = time.monotonic() - asked
        assert not thread.is_alive(), "the worker ignored the drain while Redis was down"
        assert took < 5.0, f"the drain took {took:.1f} s"
        aof.start()
        client = aof.client()
        pending = client.xpending(contracts.queue("tiny", "w1"), contracts.WORKER_GROUP)
        assert pending["pending"] == 1  # left for a reaper, not acknowledged
    finally:
        service.drain()
        if thread.is_alive() and aof.proc is None:
            aof.start()  # let a worker that waits for Redis get through its drain
        thread.join(30)
        client.close()


_SLOW = """
local t = redis.call('TIME')
repeat
    local n = redis.call('TIME')
until (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > 400000
return 1
"""


def test_the_worker_client_does_not_run_a_transaction_twice(aof: RedisProcess) -> None:
    """A transaction whose reply is lost (here: it outlasts the socket timeout) has run; the worker's client
    must not send it again, or a step's output events would be written twice."""
    r = connect_sync(aof.url, socket_timeout=0.2)
    pipe = r.pipeline(transaction=True)
    pipe.xadd(contracts.output("tiny", "twice"), {"e": "x"})
    pipe.eval(_SLOW, 0)
    with pytest.raises(redis.TimeoutError):
        pipe.execute()
    client = aof.client()
    wait_for(lambda: client.ping(), 5, "the script to end")
    time.sleep(0.5)  # a retried transaction would have run by now
    assert client.xlen(contracts.output("tiny", "twice")) == 1
    r.close()
    client.close()


def test_an_entry_read_by_a_lost_reply_is_started_even_when_the_worker_is_full(
    zoo: ZooPaths, aof: RedisProcess
) -> None:
    """A read whose reply was lost leaves its entries pending on the worker, which does not know them; no
    reaper takes entries from a live worker, so the re-sync after the error must start them, even while
    the engine has no room for new work."""
    r = connect_sync(aof.url, socket_timeout=0.3)
    registry = AdapterRegistry(r, "tiny")
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=256, max_num_seqs=1))
    service = WorkerService(engine, r, "w1", "tiny", registry, max_waiting=1)
    client = aof.client()
    long = SamplingParams(max_tokens=1900, ignore_eos=True)
    with running(service):
        enqueue(client, QueuedRequest("runs", "tiny", prompt(1), long))
        enqueue(client, QueuedRequest("waits", "tiny", prompt(2), SamplingParams(max_tokens=4)))
        wait_for(lambda: len(engine.scheduler.waiting) == 1, 30, "a full worker")
        # A read as w1 whose reply never arrived: the entry is pending on w1, unknown to it.
        enqueue(client, QueuedRequest("stranded", "tiny", prompt(3), SamplingParams(max_tokens=4)))
        client.xreadgroup(contracts.WORKER_GROUP, "w1", {contracts.queue("tiny", "w1"): ">"})
        outages = service.outages
        client.client_pause(1000)  # the worker's next command times out: it re-syncs when Redis answers
        wait_for(lambda: service.outages > outages, 30, "the re-sync")
        assert service.intake.room() <= 0 and "runs" in service.active  # it was full all along
        wait_for(lambda: "stranded" in service.active, 30, "the stranded entry taken by the full worker")
        # Its length only kept the worker full; cancelled, it makes room for the stranded one (one at a time).
        client.publish(contracts.CANCEL, "runs")
        assert collect(client, "runs")[-1].finish_reason == "abort"
        events = collect(client, "stranded", timeout=60)
        assert events[-1].completion_tokens == 4
    client.close()


def test_a_request_queued_again_after_redis_lost_it_keeps_its_record(aof: RedisProcess) -> None:
    """The gateway finds a request through its record (`lg:req:{model}:id`: queue, entry); once the worker
    queued a running request again under a new entry id, a client's retry with the same id must attach
    to it."""
    r = aof.client()
    queue = contracts.queue("tiny", "w1")
    r.xgroup_create(queue, contracts.WORKER_GROUP, id="0", mkstream=True)
    msg = QueuedRequest("kept", "tiny", prompt(1), SamplingParams(max_tokens=8))
    fp = fingerprint(msg)

    async def gateway(retry: bool) -> bool:
        """The gateway queues the request (its first try), or finds it (a retry); on its own loop."""
        store_client = connect_async(aof.url)
        try:
            store = RequestStore(store_client, ttl_s=600, model="tiny")
            if retry:
                return await store.exists("kept", fp)
            pipe = store_client.pipeline(transaction=False)
            store.enqueue(pipe, msg, fp, "w1")
            return bool((await pipe.execute())[0])
        finally:
            await store_client.aclose()

    assert asyncio.run(gateway(retry=False))
    (old_id, _), *_ = r.xreadgroup(contracts.WORKER_GROUP, "w1", {queue: ">"})[0][1]
    ledger = Ledger(r, "w1", "tiny")
    ledger.hold(Held(old_id.decode(), msg))
    r.xack(queue, contracts.WORKER_GROUP, old_id)  # Redis lost the entry (no output written yet either)
    r.xdel(queue, old_id)
    assert ledger.reclaim(lost=True) == ([], [])
    new_id = ledger.active["kept"].entry_id
    record = r.hgetall(contracts.request_record("tiny", "kept"))
    assert record[b"queue"].decode() == queue and record[b"entry"].decode() == new_id
    # A client's retry attaches to the running request instead of queueing a second copy.
    assert asyncio.run(gateway(retry=True))
    r.close()


def test_an_entry_whose_read_redis_lost_is_not_started_a_second_time(aof: RedisProcess) -> None:
    """An AOF restart may keep an entry but lose its read (the last second): the worker queues its running
    request again, and the old, now unread entry must not come back to it as a new request."""
    r = aof.client()
    queue = contracts.queue("tiny", "w1")
    r.xgroup_create(queue, contracts.WORKER_GROUP, id="0", mkstream=True)
    msg = QueuedRequest("once", "tiny", prompt(1), SamplingParams(max_tokens=8))
    old_id = r.xadd(queue, {"m": msg.to_json()}).decode()  # read by w1, but Redis lost the read
    ledger = Ledger(r, "w1", "tiny")
    ledger.hold(Held(old_id, msg))
    assert ledger.reclaim(lost=True) == ([], [])  # nothing else to start
    entries = r.xrange(queue)
    assert [e[0].decode() for e in entries] == [ledger.active["once"].entry_id] != [old_id]
    assert r.xpending(queue, contracts.WORKER_GROUP)["pending"] == 1
    r.close()
