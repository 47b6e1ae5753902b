"""Stage enqueue on a real Redis: a queued request keeps its reservation; every other path (a copy
queued first, a conflicting retry, Redis failing) releases it and refunds the charge, exactly once."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.admit import Charge
from gateway.pipeline.enqueue import attach, enqueue
from gateway.pipeline.job import Job
from gateway.pipeline.route import route, route_input
from loragate import contracts
from policies.routing_state import Phase, Reservation
from policies.types import RouteDecision
from tests.e2e.stack import free_port
from tests.gateway.pipeline.live_context import BASE, TENANT, job, prompt, resolved, run


def routed(ctx: GatewayContext, j: Job) -> tuple[RouteDecision, Reservation, Charge]:
    charge = Charge(ctx.admission, TENANT, BASE, 1.0)
    decision, reservation = route(ctx, route_input(j, resolved(ctx), prompt(40)), charge)
    return decision, reservation, charge


def outstanding(ctx: GatewayContext) -> int:
    return sum(w.queue_len for w in ctx.fleet.workers.values())


def test_a_queued_request_holds_its_reservation(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        j = job(ctx)
        decision, reservation, charge = routed(ctx, j)
        reader = await enqueue(ctx, j, decision, reservation, charge)
        assert reader.reservation is reservation and reservation.phase is Phase.QUEUED
        assert await ctx.redis.xlen(contracts.queue(BASE, reservation.worker_id)) == 1
        assert await ctx.decisions.get(decision.decision_id) is not None
        assert outstanding(ctx) == 1 and not charge.settled
        reader.finish()
        assert outstanding(ctx) == 0

    run(redis_url, body)


def test_a_copy_queued_first_releases_and_refunds(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        first, second = job(ctx), job(ctx)  # one client id, two tries at once
        queued = await enqueue(ctx, first, *routed(ctx, first))
        decision, reservation, charge = routed(ctx, second)
        attached = await enqueue(ctx, second, decision, reservation, charge)
        assert attached.reservation is None and reservation.phase is Phase.RELEASED and charge.settled
        assert outstanding(ctx) == 1  # the first try's only
        assert queued.reservation is not None and queued.reservation.phase is Phase.QUEUED

    run(redis_url, body)


def test_a_retry_asking_something_else_is_409_and_releases(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        first = job(ctx)
        await enqueue(ctx, first, *routed(ctx, first))
        other = dataclasses.replace(job(ctx), fingerprint="something else")
        decision, reservation, charge = routed(ctx, other)
        with pytest.raises(APIError) as e:
            await enqueue(ctx, other, decision, reservation, charge)
        assert e.value.status == 409
        assert reservation.phase is Phase.RELEASED and charge.settled and outstanding(ctx) == 1

    run(redis_url, body)


def test_redis_failing_releases_and_refunds(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        j = job(ctx)
        decision, reservation, charge = routed(ctx, j)
        down = aioredis.Redis(port=free_port(), socket_connect_timeout=1)  # nothing listens there
        try:
            with pytest.raises(OSError):
                await enqueue(dataclasses.replace(ctx, redis=down), j, decision, reservation, charge)
        finally:
            await down.aclose()
        assert reservation.phase is Phase.RELEASED and charge.settled and outstanding(ctx) == 0

    run(redis_url, body)


def test_a_retry_attaches_without_a_reservation(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        first = job(ctx)
        await enqueue(ctx, first, *routed(ctx, first))
        retry = job(ctx)
        assert await retry.is_retry(ctx)
        reader = await attach(ctx, retry, BASE)
        assert reader.reservation is None and outstanding(ctx) == 1
        reader.finish()
        assert outstanding(ctx) == 1  # the first try still accounts for it

    run(redis_url, body)
