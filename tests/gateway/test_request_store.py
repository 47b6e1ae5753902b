"""The request record's scripts on a real Redis: ids scoped by tenant, enqueue once, cancel drops only
entries no worker has read, and an aborted request is queued again once, however many handlers ask."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from gateway.errors import APIError
from gateway.fleet import Fleet
from gateway.reaper import Reaper
from gateway.request_store import RequestStore, fingerprint
from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest, WorkerState
from loragate.types import SamplingParams

WORKER = "w-store"


def message(rid: str, prompt: tuple[int, ...] = (1, 2, 3)) -> QueuedRequest:
    return QueuedRequest(rid, "tiny", prompt, SamplingParams(max_tokens=8), tenant="alice")


def run(redis_url: str, body: Callable[[aioredis.Redis, RequestStore], Awaitable[None]]) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            await r.xgroup_create(
                contracts.queue("tiny", WORKER), contracts.WORKER_GROUP, id="0", mkstream=True
            )
            await asyncio.wait_for(body(r, RequestStore(r, ttl_s=60, model="tiny")), 10)
        finally:
            await r.aclose()

    asyncio.run(main())


async def enqueue(r: aioredis.Redis, store: RequestStore, msg: QueuedRequest) -> str | None:
    pipe = r.pipeline(transaction=False)
    store.enqueue(pipe, msg, fingerprint(msg), WORKER)
    (entry,) = await pipe.execute()
    return entry.decode() if entry is not None else None


def test_the_same_client_id_of_two_tenants_names_two_requests() -> None:
    alice, bob = (
        contracts.scoped_request_id("alice", "req-0001"),
        contracts.scoped_request_id("bob", "req-0001"),
    )
    assert alice != bob and alice == contracts.scoped_request_id("alice", "req-0001")
    assert contracts.client_request_id(alice) == contracts.client_request_id(bob) == "req-0001"
    # Tenant names are hashed: "a" + "b/x" and "a/b" + "x" cannot meet (`/` is not allowed in a client id).
    assert contracts.scoped_request_id("a", "b/x") != contracts.scoped_request_id("a/b", "x")


def test_a_request_is_queued_once_and_a_retry_must_ask_the_same(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: RequestStore) -> None:
        msg = message(contracts.scoped_request_id("alice", "once-0001"))
        assert not await store.exists(msg.request_id, fingerprint(msg))
        assert await enqueue(r, store, msg) is not None
        assert await enqueue(r, store, msg) is None  # the second try attaches, no second copy
        assert await r.xlen(contracts.queue("tiny", WORKER)) == 1
        assert await store.exists(msg.request_id, fingerprint(msg))
        assert 0 < await r.ttl(contracts.request_record("tiny", msg.request_id)) <= 60
        other = replace(msg, prompt_token_ids=(9, 9))
        with pytest.raises(APIError) as e:
            await store.exists(msg.request_id, fingerprint(other))
        assert e.value.status == 409 and e.value.param == "X-Request-Id"

    run(redis_url, body)


def test_cancel_drops_an_entry_no_worker_has_read_and_writes_its_abort(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: RequestStore) -> None:
        msg = message(contracts.scoped_request_id("alice", "queued-0001"))
        await enqueue(r, store, msg)
        assert await store.cancel(msg.request_id) is True
        assert await r.xlen(contracts.queue("tiny", WORKER)) == 0  # no worker will ever read it
        (_, fields), *rest = await r.xrange(contracts.output("tiny", msg.request_id))
        assert not rest and OutputEvent.from_json(fields[b"e"]).finish_reason == "abort"

    run(redis_url, body)


def test_cancel_of_an_entry_a_worker_has_read_goes_to_the_worker(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: RequestStore) -> None:
        msg = message(contracts.scoped_request_id("alice", "running-0001"))
        await enqueue(r, store, msg)
        await r.xreadgroup(
            contracts.WORKER_GROUP, WORKER, {contracts.queue("tiny", WORKER): ">"}
        )  # the worker has it
        pubsub = r.pubsub()
        await pubsub.subscribe(contracts.CANCEL)
        try:
            assert await store.cancel(msg.request_id) is False
            assert (
                await r.xlen(contracts.queue("tiny", WORKER)) == 1
            )  # its worker acknowledges it when it ends
            got = None
            while got is None:
                got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            assert got["data"].decode() == msg.request_id
            assert not await r.exists(contracts.output("tiny", msg.request_id))
        finally:
            await pubsub.aclose()

    run(redis_url, body)


def test_an_aborted_request_is_queued_again_once(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: RequestStore) -> None:
        msg = message(contracts.scoped_request_id("alice", "revive-0001"))
        await enqueue(r, store, msg)
        await store.cancel(msg.request_id)
        ((abort_id, _),) = await r.xrange(contracts.output("tiny", msg.request_id))
        fp = fingerprint(msg)
        again = replace(msg, attempt=1)
        tries = (store.revive(abort_id.decode(), again, fp, WORKER) for _ in range(5))
        results = await asyncio.gather(*tries)
        assert sum(entry is not None for entry in results) == 1  # five handlers saw the abort; one queues
        assert await r.xlen(contracts.output("tiny", msg.request_id)) == 0  # the abort event is gone
        ((_, fields),) = await r.xrange(contracts.queue("tiny", WORKER))
        assert QueuedRequest.from_json(fields[b"m"]).attempt == 1
        # The record points at the new entry: a cancel now drops that one.
        assert await store.cancel(msg.request_id) is True
        assert await r.xlen(contracts.queue("tiny", WORKER)) == 0
        # A stale abort id (not the stream's last entry any more) queues nothing.
        assert await store.revive(abort_id.decode(), again, fp, WORKER) is None

    run(redis_url, body)


def test_a_request_that_ended_and_whose_output_expired_can_be_made_anew(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: RequestStore) -> None:
        msg = message(contracts.scoped_request_id("alice", "expired-0001"))
        await enqueue(r, store, msg)
        ((entry, _),) = await r.xrange(contracts.queue("tiny", WORKER))
        assert await store.exists(msg.request_id, fingerprint(msg))  # queued: live, though no output yet
        await r.xdel(contracts.queue("tiny", WORKER), entry)  # what its worker does when it ends
        await r.xadd(
            contracts.output("tiny", msg.request_id), {"e": OutputEvent(finish_reason="length").to_json()}
        )
        assert await store.exists(msg.request_id, fingerprint(msg))  # ended: its output is relayed again
        await r.delete(contracts.output("tiny", msg.request_id))  # the output expired; the record outlives it
        other = replace(msg, prompt_token_ids=(7, 7))
        assert not await store.exists(msg.request_id, fingerprint(other))  # a new request, no 409
        assert await enqueue(r, store, other) is not None

    run(redis_url, body)


def test_the_reaper_points_the_record_at_the_entry_it_moved(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: RequestStore) -> None:
        msg = message(contracts.scoped_request_id("alice", "moved-0001"))
        await enqueue(r, store, msg)  # on WORKER, which has no heartbeat: dead
        live = WorkerState("w-live", "tiny", "/m", 2048)
        await r.set(contracts.worker_state("tiny", "w-live"), live.to_json(), ex=30)
        await r.xgroup_create(
            contracts.queue("tiny", "w-live"), contracts.WORKER_GROUP, id="0", mkstream=True
        )
        fleet = Fleet(r)
        await fleet.refresh()
        assert await Reaper(r, fleet, "reaper-test")._drain(contracts.queue("tiny", WORKER)) == 1
        assert (
            await r.xlen(contracts.queue("tiny", WORKER)) == 0
            and await r.xlen(contracts.queue("tiny", "w-live")) == 1
        )
        record = await r.hgetall(contracts.request_record("tiny", msg.request_id))
        assert record[b"queue"].decode() == contracts.queue("tiny", "w-live")
        assert await store.exists(msg.request_id, fingerprint(msg))  # a retry attaches to the moved entry
        assert await enqueue(r, store, msg) is None
        assert await store.cancel(msg.request_id) is True  # and a cancel drops it from its new queue
        assert await r.xlen(contracts.queue("tiny", "w-live")) == 0

    run(redis_url, body)
