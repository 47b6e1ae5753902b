"""The overload bounds (`gateway.overload`), table-driven, and `FairAdmission` applying them: over a
bound a request is refused at once with 429 and a `Retry-After` from the measured drain rate; a light
tenant is still admitted while a flooding one is refused."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.admission import FairAdmission
from gateway.errors import APIError
from gateway.fleet import Fleet, WorkerView
from gateway.overload import Bounds, Limits, judge
from gateway.queue_estimate import Load
from gateway.settings import GatewaySettings
from loragate.messages import WorkerState


def view(worker_id: str, outstanding: int, running: int, waiting: int = 0) -> WorkerView:
    return WorkerView(
        WorkerState(worker_id, "tiny", "/m", 2048, running=running, waiting=waiting), outstanding
    )


# -- judge: one named case per branch ------------------------------------------------------------------
JUDGE_CASES = [
    # name, limits, tenant, load, expected (code, Retry-After) or None
    ("no bounds admit anything", Limits(), "a", Load(1000, {}, 1.0), None),
    ("under the wait bound", Limits(10), "a", Load(4, {}, 1.0), None),  # (5 + 2√5) / 1 = 9.5 s
    ("just over the wait bound", Limits(10), "a", Load(5, {}, 1.0), ("queue_wait_exceeded", 1)),  # 10.9 s
    # (26 + 2√26) / 2 = 18.1 s; 12.8 requests fit in 10 s (n + 2√n = 20): 13.2 too many at 2/s.
    ("over the wait bound", Limits(10), "a", Load(25, {}, 2.0), ("queue_wait_exceeded", 7)),
    ("unknown drain: wait bound not applied", Limits(10), "a", Load(100, {}, 0.0), None),
    ("unknown drain: count bound still applies", Limits(10, 50), "a", Load(100, {}, 0.0), ("queue_full", 1)),
    ("model max_queued counts the fair queue", Limits(0, 10), "a", Load(8, {"a": 2}, 2.0), ("queue_full", 1)),
    ("model max_queued, one below", Limits(0, 10), "a", Load(8, {"a": 1}, 2.0), None),
    (
        "a model's wait bound wins over the default",
        Limits(10, models={"tiny": Bounds(wait_bound_s=2)}),
        "a",
        Load(6, {}, 2.0),
        ("queue_wait_exceeded", 3),
    ),
    (
        "a tenant's wait bound wins over its model's",
        Limits(10, models={"tiny": Bounds(wait_bound_s=2)}, tenants={"batch": Bounds(wait_bound_s=60)}),
        "batch",
        Load(6, {}, 2.0),
        None,
    ),
    (
        "'*' bounds every tenant's queue",
        Limits(tenants={"*": Bounds(max_queued=3)}),
        "a",
        Load(0, {"a": 3}, 1.0),
        ("queue_full", 1),
    ),
    (
        "a tenant's own entry wins over '*'",
        Limits(tenants={"*": Bounds(max_queued=3), "a": Bounds(max_queued=10)}),
        "a",
        Load(0, {"a": 3}, 1.0),
        None,
    ),
    (
        "tenant max_queued: Retry-After counts the other tenants' turns",
        Limits(tenants={"a": Bounds(max_queued=2)}),
        "a",
        Load(0, {"a": 3, "b": 5}, 2.0),
        ("queue_full", 2),  # (3 - 2 + 1) of a's requests, each after one of b's, at 2/s
    ),
    ("a light tenant behind a flood is admitted", Limits(8), "light", Load(4, {"flood": 40}, 2.0), None),
    (
        "the flooding tenant is refused",
        Limits(8),
        "flood",
        Load(4, {"flood": 40}, 2.0),
        ("queue_wait_exceeded", 18),
    ),
    ("Retry-After is capped", Limits(1), "a", Load(10**6, {}, 1.0), ("queue_wait_exceeded", 600)),
]


@pytest.mark.parametrize(
    ("limits", "tenant", "load", "expected"), [c[1:] for c in JUDGE_CASES], ids=[c[0] for c in JUDGE_CASES]
)
def test_judge(limits: Limits, tenant: str, load: Load, expected: tuple[str, int] | None) -> None:
    refusal = judge(limits, tenant, "tiny", load)
    if expected is None:
        assert refusal is None
        return
    assert refusal is not None
    assert (refusal.code, refusal.retry_after_s) == expected
    error = refusal.error()
    assert error.status == 429 and error.type == "rate_limit_error"
    assert error.headers["Retry-After"] == str(expected[1])


# -- configuration ---------------------------------------------------------------------------------------
def test_limits_from_the_gateway_settings() -> None:
    settings = GatewaySettings(
        "redis://unused",
        admission_wait_bound_s=8,
        admission_max_queued=100,
        admission_models={"tiny": {"wait_bound_s": 2}},
        admission_tenants={"*": {"max_queued": 5}, "batch": {"wait_bound_s": 60, "max_queued": 500}},
    )
    limits = Limits.from_settings(settings)
    assert limits.wait_bound("alice", "tiny") == 2.0
    assert limits.wait_bound("alice", "small") == 8.0
    assert limits.wait_bound("batch", "tiny") == 60.0
    assert (limits.model_max_queued("tiny"), limits.tenant_max_queued("alice")) == (100, 5)
    assert limits.tenant_max_queued("batch") == 500


BAD_CONFIG = [
    ({"admission_tenants": {"bob": {"max_queue": 3}}}, "admission_tenants.bob.max_queue: unknown key"),
    ({"admission_models": {"tiny": {"wait_bound_s": -1}}}, "admission_models.tiny.wait_bound_s: must be"),
    ({"admission_models": {"tiny": 5}}, "admission_models.tiny: must be a mapping"),
    ({"admission_models": ["tiny"]}, "admission_models: must be a mapping"),
    ({"admission_max_queued": 2.5}, "admission_max_queued: must be a whole number"),
    ({"admission_wait_bound_s": "10"}, "admission_wait_bound_s: must be a number"),
    ({"admission_tenants": {"a": {"max_queued": True}}}, "admission_tenants.a.max_queued: must be"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIG, ids=[m.split(":")[0] for _, m in BAD_CONFIG])
def test_a_bad_bound_is_a_clear_error(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("*", r"\*")):
        Limits.from_settings(GatewaySettings("redis://unused", **config))  # type: ignore[arg-type]


# -- FairAdmission applies them --------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def admission_with(
    outstanding: int, running: int, limits: Limits, per_worker: int = 48, waiting: int = 0
) -> FairAdmission:
    fleet = Fleet(aioredis.Redis())  # never contacted: admission reads the snapshot only
    fleet.workers = {"w1": view("w1", outstanding, running, waiting)}
    return FairAdmission(fleet, per_worker=per_worker, limits=limits, tick_s=0.001, clock=Clock())


def serve(admission: FairAdmission, finished: int, over_s: float) -> None:
    """`finished` requests end (through `settle`, as the request path does) over `over_s` seconds."""
    clock = admission.clock
    assert isinstance(clock, Clock)
    admission.meter("tiny")  # the meter starts now
    for _ in range(finished):
        admission.settle("someone", "tiny", 30.0, 10, 10)
    clock.t += over_s


def test_over_the_wait_bound_is_refused_at_once_with_a_computed_retry_after() -> None:
    async def run() -> None:
        admission = admission_with(outstanding=30, running=8, limits=Limits(5), waiting=8)  # 22 not running
        serve(admission, finished=20, over_s=10.0)  # 2 requests/s: (23 + 2√23) / 2 = 16.3 s of wait
        started = time.monotonic()
        with pytest.raises(APIError) as e:
            await admission.admit("a", "tiny", 10, 10)
        assert time.monotonic() - started < 0.05
        assert e.value.status == 429 and e.value.code == "queue_wait_exceeded"
        assert e.value.headers["Retry-After"] == "9"  # 5.4 of the 23 fit in 5 s; the rest drain at 2/s
        assert e.value.headers["x-loragate-estimated-wait-s"] == "16.30"
        assert admission.rejected["queue_wait_exceeded"] == 1

    asyncio.run(run())


def test_within_the_wait_bound_is_admitted() -> None:
    async def run() -> None:
        admission = admission_with(outstanding=30, running=8, limits=Limits(17), waiting=8)
        serve(admission, finished=20, over_s=10.0)
        await asyncio.wait_for(admission.admit("a", "tiny", 10, 10), 0.5)
        assert not admission.rejected

    asyncio.run(run())


def test_requests_that_never_ran_do_not_count_as_drained() -> None:
    admission = admission_with(outstanding=30, running=8, limits=Limits(5), waiting=8)
    admission.meter("tiny")
    for _ in range(20):
        admission.settle("a", "tiny", 30.0, 0, 0)  # routing or enqueue failed
    assert admission.load("tiny").drain_rps == 0.0


def test_a_flooding_tenant_is_refused_while_a_light_one_is_admitted() -> None:
    async def run() -> None:
        # The worker is full (no room: everything waits in the fair queue), 2 requests/s drain, 6 s bound.
        admission = admission_with(outstanding=8, running=8, limits=Limits(6), per_worker=8)
        serve(admission, finished=20, over_s=10.0)
        flood = [asyncio.create_task(admission.admit("flood", "tiny", 10, 10)) for _ in range(12)]
        await asyncio.sleep(0.01)
        light = asyncio.create_task(admission.admit("light", "tiny", 10, 10))
        await asyncio.sleep(0.01)
        refused = [t for t in flood if t.done() and isinstance(t.exception(), APIError)]
        assert len(refused) == 6  # 0..5 ahead fit in 6 s at 2/s ((6 + 2√6) / 2 = 5.4 s); 6 do not
        assert not light.done()  # the light tenant waits for its fair turn, it is not refused
        assert admission.queues["tiny"].queued() == {"flood": 6, "light": 1}
        for t in (*flood, light):
            t.cancel()
        await asyncio.gather(*flood, light, return_exceptions=True)
        await admission.stop()

    asyncio.run(run())


def test_the_backstop_429_retry_after_comes_from_the_drain_rate() -> None:
    async def run() -> None:
        admission = admission_with(outstanding=9, running=0, limits=Limits(0), per_worker=4, waiting=9)
        admission.max_wait_s = 0.05
        serve(admission, finished=4, over_s=2.0)  # 2 requests/s
        with pytest.raises(APIError) as e:
            await admission.admit("a", "tiny", 10, 10)
        assert e.value.code == "overloaded" and e.value.headers["Retry-After"] == "5"  # 9 ahead at 2/s
        await admission.stop()

    asyncio.run(run())
