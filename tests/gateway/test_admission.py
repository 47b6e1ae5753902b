"""Fair admission: below capacity nothing waits; at capacity a flooding tenant cannot starve a light one;
a request that waits too long gets 429."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.admission import FairAdmission
from gateway.errors import APIError
from gateway.fleet import Fleet, WorkerView
from loragate.messages import WorkerState


def fleet_with(outstanding: int) -> Fleet:
    f = Fleet(aioredis.Redis())  # never contacted: admission reads the snapshot only
    f.workers = {"w1": WorkerView(WorkerState("w1", "tiny", "/m", 2048), outstanding)}
    return f


def set_outstanding(f: Fleet, n: int) -> None:
    f.workers["w1"] = WorkerView(f.workers["w1"].state, n)


def test_below_capacity_nothing_waits() -> None:
    async def run() -> None:
        admission = FairAdmission(fleet_with(0), per_worker=4)
        await asyncio.wait_for(admission.admit("a", "tiny", 10, 10), 0.5)
        assert admission.waited == 0

    asyncio.run(run())


def test_at_capacity_a_request_waits_until_room_frees() -> None:
    """The positive control of the test above: the same request, with the worker full, waits."""

    async def run() -> None:
        f = fleet_with(4)
        admission = FairAdmission(f, per_worker=4, tick_s=0.001)
        waiting = asyncio.create_task(admission.admit("a", "tiny", 10, 10))
        await asyncio.sleep(0.05)
        assert not waiting.done() and admission.waited == 1
        set_outstanding(f, 3)
        await asyncio.wait_for(waiting, 0.5)

    asyncio.run(run())


def test_a_flood_does_not_starve_a_light_tenant() -> None:
    async def run() -> list[str]:
        f = fleet_with(4)
        admission = FairAdmission(f, per_worker=4, tick_s=0.001)
        order: list[str] = []

        async def one(tenant: str) -> None:
            await admission.admit(tenant, "tiny", 100, 100)
            order.append(tenant)

        flood = [asyncio.create_task(one("flood")) for _ in range(30)]
        await asyncio.sleep(0.01)
        light = [asyncio.create_task(one("light")) for _ in range(3)]
        await asyncio.sleep(0.01)
        for _ in range(33):  # capacity frees one request at a time
            set_outstanding(f, 3)
            await asyncio.sleep(0.003)
            set_outstanding(f, 4)
            await asyncio.sleep(0.001)
        await asyncio.wait_for(asyncio.gather(*flood, *light), 10)
        return order

    order = asyncio.run(run())
    last_light = max(i for i, t in enumerate(order) if t == "light")
    assert last_light < 10, order  # the light tenant's three went within the first releases, not after 30


def test_waiting_too_long_is_a_429() -> None:
    async def run() -> None:
        admission = FairAdmission(fleet_with(9), per_worker=4, max_wait_s=0.05)
        with pytest.raises(APIError) as e:
            await admission.admit("a", "tiny", 10, 10)
        # Nothing has finished yet, so the drain rate is unknown: retry after a second.
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"

    asyncio.run(run())


def test_by_default_each_worker_takes_its_own_batch_capacity() -> None:
    f = Fleet(aioredis.Redis())
    f.workers = {
        "big": WorkerView(WorkerState("big", "tiny", "/m", 2048, max_running=128), 100),
        "small": WorkerView(WorkerState("small", "tiny", "/m", 2048, max_running=8), 3),
        "old": WorkerView(WorkerState("old", "tiny", "/m", 2048), 40),  # says nothing: the default
    }
    assert FairAdmission(f).room("tiny") == (128 - 100) + (8 - 3) + (48 - 40)
    assert FairAdmission(f, per_worker=50).room("tiny") == 0 + (50 - 3) + (50 - 40)  # configured: for all
