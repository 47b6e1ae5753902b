"""ModelCatalog: the `model` field → a base model and adapter, against a real Redis registry. Bases served
now, served before (this gateway's memory or `lg:models`), adapters by key or unambiguous bare name, per
tenant; `auto` → the least-loaded live base; every refusal has its status and code."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from gateway.errors import APIError
from gateway.fleet import Fleet
from gateway.model_catalog import AUTO, ModelCatalog, Target
from loragate import contracts
from loragate.messages import AdapterRecord, WorkerState

A_TINY = AdapterRecord("a", "tiny", "/adapters/tiny/a")
A_SMALL = AdapterRecord("a", "small", "/adapters/small/a", tenants=("bob",))
PRIVATE = AdapterRecord("secret", "tiny", "/adapters/tiny/secret", tenants=("bob",))
SOLO = AdapterRecord("solo", "small", "/adapters/small/solo")


@dataclass(frozen=True)
class View:
    state: WorkerState
    load: int


@dataclass
class StubFleet:
    """What the catalog reads of the fleet: live workers and one state per served base."""

    workers: dict[str, View] = field(default_factory=dict)

    def add(self, worker_id: str, model: str, load: int = 0, draining: bool = False) -> None:
        state = WorkerState(worker_id, model, f"/m/{model}", 512, draining=draining)
        self.workers[worker_id] = View(state, load)

    def models(self) -> dict[str, WorkerState]:
        out: dict[str, WorkerState] = {}
        for w in self.workers.values():
            out.setdefault(w.state.model, w.state)
        return out


def _run(
    redis_url: str, fleet: StubFleet, body: Callable[[ModelCatalog, aioredis.Redis], Awaitable[Any]]
) -> Any:
    async def main() -> Any:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            for rec in (A_TINY, A_SMALL, PRIVATE, SOLO):
                await r.hset(contracts.ADAPTERS, rec.key, rec.to_json())
            return await body(ModelCatalog(r, cast(Fleet, fleet)), r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def _fleet() -> StubFleet:
    fleet = StubFleet()
    fleet.add("t1", "tiny", load=4)
    fleet.add("s1", "small", load=1)
    return fleet


def _resolve(redis_url: str, model: object, tenant: str = "alice", fleet: StubFleet | None = None) -> Target:
    return cast(Target, _run(redis_url, fleet or _fleet(), lambda c, _: c.resolve(model, tenant)))


@pytest.mark.parametrize(
    ("model", "tenant", "expected"),
    [
        pytest.param("tiny", "alice", Target("tiny", None), id="a served base"),
        pytest.param("tiny:a", "alice", Target("tiny", A_TINY), id="adapter by key"),
        pytest.param("solo", "alice", Target("small", SOLO), id="unique bare adapter name"),
        pytest.param("a", "alice", Target("tiny", A_TINY), id="bare name: only one allows the tenant"),
        pytest.param("small:a", "bob", Target("small", A_SMALL), id="a tenant's adapter by key"),
        pytest.param(AUTO, "alice", Target("small", None), id="auto: the least loaded base"),
    ],
)
def test_resolves(redis_url: str, model: str, tenant: str, expected: Target) -> None:
    assert _resolve(redis_url, model, tenant) == expected


@pytest.mark.parametrize(
    ("model", "tenant", "status", "code", "words"),
    [
        pytest.param(None, "alice", 400, None, "non-empty string", id="missing"),
        pytest.param("", "alice", 400, None, "non-empty string", id="empty"),
        pytest.param(7, "alice", 400, None, "non-empty string", id="a number"),
        pytest.param(
            "a", "bob", 400, None, "ambiguous; use one of: small:a, tiny:a", id="ambiguous bare name"
        ),
        pytest.param("nope", "alice", 404, "model_not_found", "'nope' does not exist", id="unknown"),
        pytest.param(
            "tiny:nope", "alice", 404, "model_not_found", "does not exist", id="unknown adapter key"
        ),
        pytest.param("secret", "alice", 404, "model_not_found", "does not exist", id="bare name not allowed"),
        pytest.param("tiny:secret", "alice", 403, "adapter_not_allowed", "tiny:secret", id="key not allowed"),
    ],
)
def test_refuses(
    redis_url: str, model: object, tenant: str, status: int, code: str | None, words: str
) -> None:
    with pytest.raises(APIError) as e:
        _resolve(redis_url, model, tenant)
    assert (e.value.status, e.value.code) == (status, code) and words in e.value.message, e.value.message
    assert e.value.param == "model"


def test_auto_skips_draining_workers_and_averages_per_worker(redis_url: str) -> None:
    fleet = StubFleet()
    fleet.add("t1", "tiny", load=3)
    fleet.add("t2", "tiny", load=1)  # tiny: 2 per worker
    fleet.add("s1", "small", load=3)  # small: 3
    fleet.add("s2", "small", load=0, draining=True)  # would make small 1.5 per worker
    assert _resolve(redis_url, AUTO, fleet=fleet) == Target("tiny", None)


def test_auto_ties_go_to_the_first_name(redis_url: str) -> None:
    fleet = StubFleet()
    fleet.add("s1", "small", load=2)
    fleet.add("t1", "tiny", load=2)
    assert _resolve(redis_url, AUTO, fleet=fleet) == Target("small", None)


def test_auto_without_a_live_worker_is_503(redis_url: str) -> None:
    fleet = StubFleet()
    fleet.add("t1", "tiny", draining=True)
    with pytest.raises(APIError) as e:
        _resolve(redis_url, AUTO, fleet=fleet)
    assert (e.value.status, e.value.code) == (503, "no_worker")


def test_a_base_seen_live_still_resolves_when_its_workers_are_gone(redis_url: str) -> None:
    fleet = _fleet()

    async def body(catalog: ModelCatalog, _: aioredis.Redis) -> Target:
        await catalog.resolve("tiny", "alice")  # seen live
        fleet.workers.clear()
        return await catalog.resolve("tiny", "alice")

    assert _run(redis_url, fleet, body) == Target("tiny", None)


@pytest.mark.parametrize(
    ("record", "known"),
    [
        pytest.param({"at": time.time() - 60}, True, id="beat a minute ago"),
        pytest.param({"at": time.time() - contracts.MODEL_MEMORY_S - 60}, False, id="beat too long ago"),
        pytest.param({"model_dir": "/m"}, False, id="no time"),
        pytest.param("not json", False, id="not JSON"),
    ],
)
def test_a_base_remembered_in_redis(redis_url: str, record: object, known: bool) -> None:
    async def body(catalog: ModelCatalog, r: aioredis.Redis) -> Target:
        raw = record if isinstance(record, str) else json.dumps(record)
        await r.hset(contracts.MODELS, "gone", raw)
        return await catalog.resolve("gone", "alice")

    if known:
        assert _run(redis_url, StubFleet(), body) == Target("gone", None)
        return
    with pytest.raises(APIError) as e:
        _run(redis_url, StubFleet(), body)
    assert e.value.status == 404


def test_adapters_are_cached_until_the_ttl_or_a_fresh_read(redis_url: str) -> None:
    async def body(catalog: ModelCatalog, r: aioredis.Redis) -> list[set[str]]:
        first = set(await catalog.adapters())
        await r.hset(contracts.ADAPTERS, "tiny:new", AdapterRecord("new", "tiny", "/n").to_json())
        cached = set(await catalog.adapters())
        fresh = set(await catalog.adapters(fresh=True))
        return [first, cached, fresh]

    first, cached, fresh = _run(redis_url, _fleet(), body)
    assert cached == first == {"tiny:a", "small:a", "tiny:secret", "small:solo"}
    assert fresh == first | {"tiny:new"}


@pytest.mark.parametrize(
    ("target", "model_id"),
    [
        pytest.param(Target("tiny", None), "tiny", id="base"),
        pytest.param(Target("tiny", A_TINY), "tiny:a", id="adapter"),
    ],
)
def test_model_id(target: Target, model_id: str) -> None:
    assert target.model_id == model_id
