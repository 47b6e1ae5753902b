"""Explainable routing: a decision's JSON, the outcome/adapter-tier counters, predicted vs actual cached
tokens, the shadow comparison, and decisions stored (with their TTL) and read back on a real Redis."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from gateway.decisions import DecisionLog, ShadowStats, decision_json
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from loragate import contracts
from loragate.contracts import AdapterTier
from policies.types import Outcome, RouteDecision

ROUTED = RouteDecision(
    decision_id="d1",
    profile="default",
    outcome=Outcome.ROUTED,
    worker_id="w1",
    reason="best total",
    scores={"prefix": {"w1": 1.0, "w2": 0.0}},
    totals={"w1": 3.0, "w2": 1.0},
    predicted_cached_tokens=32,
    adapter_tier=AdapterTier.HOST,
    candidates=("w1", "w2"),
)
NO_WORKER = RouteDecision("d2", "default", Outcome.NO_WORKER, None, "no worker serves tiny")


def _metrics() -> GatewayMetrics:
    return GatewayMetrics(cast(Fleet, SimpleNamespace(workers={})))  # the fleet is read only at scrape time


def test_decision_json_is_the_decision_with_its_request() -> None:
    assert json.loads(decision_json(ROUTED, "req-1")) == {
        "decision_id": "d1",
        "profile": "default",
        "outcome": "routed",
        "worker_id": "w1",
        "reason": "best total",
        "scores": {"prefix": {"w1": 1.0, "w2": 0.0}},
        "totals": {"w1": 3.0, "w2": 1.0},
        "predicted_cached_tokens": 32,
        "adapter_tier": "host",
        "candidates": ["w1", "w2"],
        "request_id": "req-1",
    }


@pytest.mark.parametrize(
    ("active", "shadow", "expected"),
    [
        pytest.param(
            ROUTED,
            ROUTED,
            {"different_worker": 0, "active_adapter_loads": 1, "shadow_adapter_loads": 1},
            id="same choice",
        ),
        pytest.param(
            ROUTED,
            replace(ROUTED, worker_id="w2", predicted_cached_tokens=0, adapter_tier=AdapterTier.DEVICE),
            {"different_worker": 1, "active_adapter_loads": 1, "shadow_adapter_loads": 0},
            id="shadow picks a worker with the adapter on device",
        ),
        pytest.param(
            replace(ROUTED, adapter_tier=AdapterTier.NONE),
            replace(ROUTED, adapter_tier=AdapterTier.DISK),
            {"different_worker": 0, "active_adapter_loads": 0, "shadow_adapter_loads": 1},
            id="no adapter vs a disk load",
        ),
    ],
)
def test_shadow_stats_record(active: RouteDecision, shadow: RouteDecision, expected: dict[str, int]) -> None:
    stats = ShadowStats()
    stats.record(active, shadow)
    report = stats.report()
    assert report["compared"] == 1
    assert {k: report[k] for k in expected} == expected
    assert report["active_predicted_cached_tokens"] == active.predicted_cached_tokens
    assert report["shadow_predicted_cached_tokens"] == shadow.predicted_cached_tokens
    assert report["different_worker_rate"] == expected["different_worker"]


def test_shadow_rate_is_rounded_and_zero_when_empty() -> None:
    stats = ShadowStats()
    assert stats.report()["different_worker_rate"] == 0
    for other in ("w1", "w2", "w2"):
        stats.record(ROUTED, replace(ROUTED, worker_id=other))
    assert stats.report()["different_worker_rate"] == 0.6667


def test_count_and_finished_feed_counters_and_metrics() -> None:
    metrics = _metrics()
    log = DecisionLog(aioredis.Redis(), metrics)  # no Redis I/O in these calls
    log.count(ROUTED)
    log.count(ROUTED)
    log.count(NO_WORKER)
    log.finished(ROUTED, actual_cached_tokens=16)
    assert log.stats() == {
        "outcomes": {"routed": 2, "no_worker": 1},
        "predicted_cached_tokens": 32,
        "actual_cached_tokens": 16,
    }
    sample = metrics.registry.get_sample_value
    assert sample("loragate_routing_decisions_total", {"outcome": "routed"}) == 2
    assert sample("loragate_routing_decisions_total", {"outcome": "no_worker"}) == 1
    assert sample("loragate_routed_adapter_tier_total", {"tier": "host"}) == 2  # only decisions with a worker
    assert sample("loragate_routed_adapter_tier_total", {"tier": "none"}) is None
    assert sample("loragate_prefix_tokens_total", {"kind": "predicted"}) == 32
    assert sample("loragate_prefix_tokens_total", {"kind": "actual"}) == 16


def test_without_metrics_only_the_counters_move() -> None:
    log = DecisionLog(aioredis.Redis())
    log.count(ROUTED)
    log.finished(ROUTED, 8)
    assert log.stats()["outcomes"] == {"routed": 1} and log.actual_cached_tokens == 8


def test_reset_shadow_starts_over() -> None:
    log = DecisionLog(aioredis.Redis())
    log.shadow.record(ROUTED, ROUTED)
    log.reset_shadow()
    assert log.shadow == ShadowStats()


def test_a_recorded_decision_is_readable_for_an_hour(redis_url: str) -> None:
    async def main() -> tuple[Any, Any, int]:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            log = DecisionLog(r)
            pipe = r.pipeline(transaction=False)
            log.record(ROUTED, "req-9", pipe)
            assert await log.get("d1") is None  # nothing is sent before the pipeline runs
            await pipe.execute()
            ttl = await r.ttl(contracts.decision("d1"))
            return await log.get("d1"), await log.get("unknown"), ttl
        finally:
            await r.aclose()

    stored, missing, ttl = asyncio.run(main())
    assert stored == json.loads(decision_json(ROUTED, "req-9")) and missing is None
    assert contracts.DECISION_TTL_S - 5 <= ttl <= contracts.DECISION_TTL_S
