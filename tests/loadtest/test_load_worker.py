"""The load-testing worker speaks the real worker's Redis protocol (against a real embedded Redis): queued
request in, one output event per fake token out with a final event and usage, the queue entry acked and
deleted only after that, a live heartbeat, cancellation, and resumption after tokens already streamed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from loadtest.load_worker import LoadWorker, LoadWorkerConfig
from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest, WorkerState
from loragate.types import SamplingParams


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    return tmp_path


MODEL = "tiny-load"  # the load worker's --model-name


@asynccontextmanager
async def running(
    url: str, model_dir: Path, interval_s: float = 0.01, max_running: int = 0
) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
    config = LoadWorkerConfig("load-t", MODEL, model_dir, interval_s, block_ms=20, max_running=max_running)
    worker = LoadWorker(r, config)
    task = asyncio.create_task(worker.run())
    try:
        yield r
    finally:
        worker.drain()
        await asyncio.wait_for(task, 10)
        assert await r.exists(contracts.worker_state(MODEL, "load-t")) == 0, "drain removes the heartbeat"
        await r.aclose()


def request(rid: str, max_tokens: int, prompt_len: int = 5) -> QueuedRequest:
    return QueuedRequest(
        rid, "tiny-load", tuple(range(8, 8 + prompt_len)), SamplingParams(max_tokens=max_tokens)
    )


async def events_of(
    r: aioredis.Redis, rid: str, until: Callable[[list[OutputEvent]], bool], timeout: float = 5.0
) -> list[OutputEvent]:
    events: list[OutputEvent] = []
    last = "0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, entries in await r.xread({contracts.output(MODEL, rid): last}, block=50) or []:
            for entry_id, fields in entries:
                last = entry_id
                events.append(OutputEvent.from_json(fields[b"e"]))
        if until(events):
            return events
    raise AssertionError(f"{rid}: only {len(events)} events after {timeout} s")


def ended(events: list[OutputEvent]) -> bool:
    return bool(events) and events[-1].is_last


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def queue_is_empty(r: aioredis.Redis) -> bool:
    """Acked and deleted (the ack follows the final event by one round trip)."""

    async def empty() -> bool:
        pending = await r.xpending(contracts.queue(MODEL, "load-t"), contracts.WORKER_GROUP)
        return int(pending["pending"]) == 0 and await r.xlen(contracts.queue(MODEL, "load-t")) == 0

    return await eventually(empty)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_emits_one_event_per_token_then_acks_and_heartbeats(redis_url: str, model_dir: Path) -> None:
    async def scenario() -> None:
        async with running(redis_url, model_dir) as r:
            assert await eventually(lambda: r.exists(contracts.worker_state(MODEL, "load-t")))
            state = WorkerState.from_json(await r.get(contracts.worker_state(MODEL, "load-t")))
            assert (state.model, state.model_dir, state.max_model_len) == ("tiny-load", str(model_dir), 1024)
            assert 0 < await r.ttl(contracts.worker_state(MODEL, "load-t")) <= 3
            await r.xadd(contracts.queue(MODEL, "load-t"), {"m": request("r1", 6).to_json()})
            events = await events_of(r, "r1", ended)
            assert [len(e.token_ids) for e in events] == [1] * 6
            assert all(e.text for e in events)
            assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
            assert (events[-1].prompt_tokens, events[-1].completion_tokens) == (5, 6)
            assert {e.worker_id for e in events} == {"load-t"}
            assert await queue_is_empty(r)
            assert 0 < await r.ttl(contracts.output(MODEL, "r1")) <= 600

    run(scenario)


def test_cancel_ends_the_sequence_with_abort(redis_url: str, model_dir: Path) -> None:
    async def scenario() -> None:
        async with running(redis_url, model_dir, interval_s=0.02) as r:
            await r.xadd(contracts.queue(MODEL, "load-t"), {"m": request("r2", 10_000).to_json()})
            await events_of(r, "r2", lambda ev: len(ev) >= 2)
            await r.publish(contracts.CANCEL, "r2")
            events = await events_of(r, "r2", ended)
            assert events[-1].finish_reason == "abort"
            assert len(events) < 100
            assert await queue_is_empty(r)

    run(scenario)


def test_resumes_after_tokens_already_streamed(redis_url: str, model_dir: Path) -> None:
    async def scenario() -> None:
        async with running(redis_url, model_dir) as r:
            earlier = OutputEvent(token_ids=(9, 10, 11), text="abc", completion_tokens=3, worker_id="dead")
            await r.xadd(contracts.output(MODEL, "r3"), {"e": earlier.to_json()})
            rerouted = dataclasses.replace(request("r3", 5), attempt=1)  # as the reaper re-routes it
            await r.xadd(contracts.queue(MODEL, "load-t"), {"m": rerouted.to_json()})
            events = await events_of(r, "r3", ended)
            assert sum(len(e.token_ids) for e in events) == 3 + 2
            assert events[-1].completion_tokens == 5
            assert await queue_is_empty(r)

    run(scenario)


def test_max_running_leaves_the_rest_queued(redis_url: str, model_dir: Path) -> None:
    """With `max_running` 2, a third request waits in the queue stream until one of the two finishes."""

    async def scenario() -> None:
        async with running(redis_url, model_dir, interval_s=0.02, max_running=2) as r:
            for i in range(3):
                await r.xadd(contracts.queue(MODEL, "load-t"), {"m": request(f"m{i}", 100).to_json()})
            first = await events_of(r, "m0", lambda ev: len(ev) >= 3)
            assert first and not await r.exists(contracts.output(MODEL, "m2"))  # not started while two run
            await asyncio.sleep(1.1)  # the next heartbeat
            state = WorkerState.from_json(await r.get(contracts.worker_state(MODEL, "load-t")))
            assert (state.running, state.waiting) == (2, 1)
            events = await events_of(r, "m2", ended)
            assert events[-1].completion_tokens == 100
            assert await queue_is_empty(r)

    run(scenario)
