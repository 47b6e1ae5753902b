"""Explainable routing: every decision is kept (in Redis, for an hour) and counted, and a shadow policy's
choices are compared with the active one's on the same live requests.

Counters are per outcome branch (routed, single, no_worker, filtered_out), and predicted vs actual cached
prompt tokens are summed when requests finish, so operators can see how good the prefix prediction is.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from gateway.metrics import GatewayMetrics
from loragate import contracts
from loragate.contracts import AdapterTier
from loragate.messages import shallow_dict
from policies.types import RouteDecision


def decision_json(decision: RouteDecision, request_id: str) -> str:
    d = shallow_dict(decision)  # the nested values are plain dicts, tuples and enums: no deep copy needed
    d["outcome"], d["adapter_tier"] = decision.outcome.value, decision.adapter_tier.value
    d["request_id"] = request_id
    return json.dumps(d)


@dataclass
class ShadowStats:
    """How a shadow policy would have routed the same requests."""

    compared: int = 0
    different_worker: int = 0
    active_predicted_cached_tokens: int = 0
    shadow_predicted_cached_tokens: int = 0
    active_adapter_loads: int = 0  # chosen worker did not have the adapter on device
    shadow_adapter_loads: int = 0

    def record(self, active: RouteDecision, shadow: RouteDecision) -> None:
        self.compared += 1
        self.different_worker += active.worker_id != shadow.worker_id
        self.active_predicted_cached_tokens += active.predicted_cached_tokens
        self.shadow_predicted_cached_tokens += shadow.predicted_cached_tokens
        self.active_adapter_loads += active.adapter_tier in (AdapterTier.HOST, AdapterTier.DISK)
        self.shadow_adapter_loads += shadow.adapter_tier in (AdapterTier.HOST, AdapterTier.DISK)

    def report(self) -> dict[str, Any]:
        n = max(1, self.compared)
        return {**asdict(self), "different_worker_rate": round(self.different_worker / n, 4)}


@dataclass
class DecisionLog:
    redis: aioredis.Redis
    metrics: GatewayMetrics | None = None
    outcomes: Counter[str] = field(default_factory=Counter)
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    shadow: ShadowStats = field(default_factory=ShadowStats)

    def count(self, decision: RouteDecision) -> None:
        self.outcomes[decision.outcome.value] += 1
        if self.metrics is not None:
            self.metrics.decisions.labels(outcome=decision.outcome.value).inc()
            if decision.worker_id is not None:
                self.metrics.adapter_tier.labels(tier=decision.adapter_tier.value).inc()

    def record(self, decision: RouteDecision, request_id: str, pipe: Pipeline) -> None:
        """Store the decision for `/admin/decisions/{id}` with the request's enqueue (`pipe`), so that
        costs no round trip of its own. (Count it with `count` once the request is on its way.)"""
        pipe.set(
            contracts.decision(decision.decision_id),
            decision_json(decision, request_id),
            ex=contracts.DECISION_TTL_S,
        )

    def finished(self, decision: RouteDecision, actual_cached_tokens: int) -> None:
        self.predicted_cached_tokens += decision.predicted_cached_tokens
        self.actual_cached_tokens += actual_cached_tokens
        if self.metrics is not None:
            self.metrics.prefix_tokens.labels(kind="predicted").inc(decision.predicted_cached_tokens)
            self.metrics.prefix_tokens.labels(kind="actual").inc(actual_cached_tokens)

    async def get(self, decision_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(contracts.decision(decision_id))
        return json.loads(raw) if raw is not None else None

    def reset_shadow(self) -> None:
        self.shadow = ShadowStats()

    def stats(self) -> dict[str, Any]:
        return {
            "outcomes": dict(self.outcomes),
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "actual_cached_tokens": self.actual_cached_tokens,
        }
