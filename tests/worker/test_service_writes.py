"""A step's writes go out on a thread of their own while the engine computes the next step
(`worker.service_writes`), against a real Redis: in step order, acks after last events, errors raised
where the loop handles them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import redis
import torch

from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest
from loragate.types import SamplingParams
from tests.worker.test_service import collect, enqueue, make_service, prompt, running
from worker.modelzoo.make import ZooPaths
from worker.service_writes import StepWrite, StepWriter, overlap_by_default

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield r
    r.config_set("maxmemory", "0")
    r.close()


def acks_and_kv(r: redis.Redis, queue: str) -> tuple:
    def add_acks(pipe: redis.client.Pipeline, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            pipe.xack(queue, contracts.WORKER_GROUP, entry_id)

    return add_acks, lambda pipe, events: None


def writer_with_entry(client: redis.Redis, queue: str) -> tuple[StepWriter, str]:
    """A writer (on its thread) acking entries of `queue`, and one entry read there, pending."""
    client.xgroup_create(queue, contracts.WORKER_GROUP, id="0", mkstream=True)
    entry = client.xadd(queue, {"m": "1"}).decode()
    client.xreadgroup(contracts.WORKER_GROUP, "w", {queue: ">"})
    return StepWriter(client, "tiny", *acks_and_kv(client, queue), overlap=True), entry


def event(n: int, last: bool = False) -> OutputEvent:
    return OutputEvent(token_ids=(n,), text=f"t{n}", finish_reason="length" if last else None)


def test_a_write_is_in_flight_while_the_caller_goes_on_and_lands_in_order(client: redis.Redis) -> None:
    queue = "q"
    writer, entry = writer_with_entry(client, queue)
    try:
        writer.submit(StepWrite(events=[("r1", event(1))]))
        assert writer.settle() is not None
        pauser = redis.Redis(connection_pool=client.connection_pool)
        pauser.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # every XADD waits 1.5 s
        t0 = time.monotonic()
        write = StepWrite(
            events=[("r1", event(2)), ("r1", event(3, last=True))], finished=["r1"], acks=[entry]
        )
        writer.submit(write)
        handed_over = time.monotonic() - t0
        assert writer.in_flight
        assert writer.settle() is write
        settled = time.monotonic() - t0
    finally:
        writer.close()
    assert handed_over < 0.5 < 1.0 < settled  # the caller was free while Redis held the write
    tokens = [
        OutputEvent.from_json(f[contracts.OUTPUT_FIELD.encode()]).token_ids[0]
        for _, f in client.xrange(contracts.output("tiny", "r1"))
    ]
    assert tokens == [1, 2, 3]
    assert client.xpending(queue, contracts.WORKER_GROUP)["pending"] == 0  # acked with its last event


def test_a_refused_write_is_raised_by_settle_and_its_ack_is_not_sent(client: redis.Redis) -> None:
    queue = "q"
    writer, entry = writer_with_entry(client, queue)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")  # every command that may grow memory is refused (OOM)
    try:
        writer.submit(StepWrite(events=[("r1", event(1, last=True))], finished=["r1"], acks=[entry]))
        with pytest.raises(redis.ResponseError):
            writer.settle()
        assert not writer.in_flight
    finally:
        client.config_set("maxmemory", "0")
        writer.close()
    assert client.xlen(contracts.output("tiny", "r1")) == 0
    assert client.xpending(queue, contracts.WORKER_GROUP)["pending"] == 1  # the MULTI aborted its ack too


def test_the_engine_computes_the_next_step_while_a_steps_write_is_sent(
    zoo: ZooPaths, client: redis.Redis
) -> None:
    """Every write made slow (100 ms more): the engine's steps start while the last step's write is still
    being sent (with writes on the step loop, none does), and the request's stream still gets every token,
    in order, acknowledged after the last."""
    service = make_service(zoo, client, overlap_writes=True)
    sends: list[tuple[float, float]] = []
    steps: list[float] = []
    send, step = service.writes._send, service.engine.step

    def slow_send(write: StepWrite) -> None:
        start = time.monotonic()
        time.sleep(0.1)
        send(write)
        sends.append((start, time.monotonic()))

    def timed_step() -> list:
        steps.append(time.monotonic())
        return step()

    service.writes._send = slow_send  # type: ignore[method-assign]
    service.engine.step = timed_step  # type: ignore[method-assign]
    with running(service):
        enqueue(
            client, QueuedRequest("r1", "tiny", prompt(1), SamplingParams(max_tokens=24, ignore_eos=True))
        )
        events = collect(client, "r1")
    tokens = [t for e in events for t in e.token_ids]
    assert len(tokens) == 24 and events[-1].finish_reason == "length"
    overlapped = [s for s in steps if any(a < s < b for a, b in sends)]
    # Not all 24: the first step has no write before it, and a step may begin only after a slow write it
    # did not wait for has ended (the loop's own read of new entries, on a busy machine).
    assert len(overlapped) >= 12, (len(overlapped), len(steps))
    assert client.xpending(contracts.queue("tiny", "w1"), contracts.WORKER_GROUP)["pending"] == 0


def test_writes_overlap_steps_only_where_the_engine_leaves_a_core_free() -> None:
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        assert overlap_by_default("cuda:0")  # the step loop only waits for the device
        torch.set_num_threads(cores)
        assert not overlap_by_default("cpu")  # the writer would preempt an OpenMP thread
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert overlap_by_default("cpu")
    finally:
        torch.set_num_threads(threads)
