"""The gateway's side of routing: turn a request and the fleet snapshot into the policy's inputs, run
the active profile (and the shadow one, if any), and keep the decision explainable.

Model aliases (`auto` or any alias in the policy) are resolved first: the policy's difficulty estimator
scores the request and `choose_rung` maps the score to a base model, stepping down a rung when that
model's pool is saturated. Candidates are every live worker serving the base, in worker-id order, each
with its outstanding requests and the prefix blocks it holds of this prompt, as the gateway's
`policies.routing_state.RoutingState` sees them (the same routing code the simulator runs).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from gateway.decisions import DecisionLog
from gateway.errors import APIError
from gateway.policy_store import PolicyHolder
from policies.alias_ladder import choose_rung, pool_saturation
from policies.difficulty import DifficultyQuery
from policies.document import Policy
from policies.routing_state import Reservation, RoutingState
from policies.types import Outcome, RouteDecision, RouteRequest

SATURATION_CAPACITY = 32.0  # outstanding requests per worker that count as a full pool


@dataclass(frozen=True)
class AliasChoice:
    model: str
    score: float
    reason: str


class Router:
    """Runs the active profile (and the shadow one) through the gateway's `RoutingState`."""

    def __init__(
        self,
        state: RoutingState,
        holder: PolicyHolder[Policy],
        log: DecisionLog,
        seed: int | None = None,
        shared_queue: bool = False,
    ):
        self.state, self.holder, self.log = state, holder, log
        self.rng = random.Random(seed)
        self.shared_queue = shared_queue  # no worker can take it: the model's shared stream, not 503/429

    def is_alias(self, model: str) -> bool:
        return model in self.holder.policy.aliases

    def resolve_alias(self, model: str, text: str, max_tokens: int) -> AliasChoice:
        policy = self.holder.policy
        alias = policy.aliases[model]
        score = policy.estimator.score(DifficultyQuery(text=text, max_tokens=max_tokens))
        candidates = self.state.candidates(None)
        saturation = pool_saturation(candidates, SATURATION_CAPACITY)
        live = {c.state.model for c in candidates if not c.state.draining}
        chosen, reason = choose_rung(alias, score, saturation)
        if chosen not in live:  # a rung with no worker: take the nearest rung that has one
            others = [m for m in alias.models if m in live]
            if not others:
                raise APIError(
                    503,
                    f"No worker serves any model of '{model}'.",
                    code="no_worker",
                    headers={"Retry-After": "2"},
                )
            chosen, reason = others[0], f"{reason}; {chosen} has no worker, using {others[0]}"
        return AliasChoice(chosen, score, reason)

    def route(self, request: RouteRequest) -> tuple[RouteDecision, Reservation | None]:
        """The decision and what it reserves on its worker (counted before any await, so concurrent
        requests see it). When no worker was chosen: 503 (none live) or 429 (all at their bound), or with
        `shared_queue` no reservation: the request goes on the model's shared stream."""
        shadow = self.holder.shadow
        routed = self.state.route(
            self.holder.policy.profile(),
            request,
            self.rng,
            uuid.uuid4().hex[:16],
            shadow.profile() if shadow is not None else None,
        )
        decision = routed.decision
        if routed.shadow is not None:
            self.log.shadow.record(decision, routed.shadow)
        if self.shared_queue and routed.reservation is None:
            return decision, None
        if decision.outcome is Outcome.NO_WORKER:
            self.log.count(decision)
            raise APIError(
                503,
                f"No worker is serving '{request.base}' right now.",
                code="no_worker",
                headers={"Retry-After": "2"},
            )
        if decision.outcome is Outcome.FILTERED_OUT or routed.reservation is None:
            self.log.count(decision)
            raise APIError(
                429,
                f"All workers serving '{request.base}' are at capacity; retry shortly. ({decision.reason})",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        return decision, routed.reservation


def decision_attributes(decision: RouteDecision) -> dict[str, str | int | float]:
    """The decision as span attributes: chosen worker, each scorer's score, prediction, adapter tier."""
    attrs: dict[str, str | int | float] = {
        "loragate.route.decision_id": decision.decision_id,
        "loragate.route.profile": decision.profile,
        "loragate.route.outcome": decision.outcome.value,
        "loragate.route.worker": decision.worker_id or "",
        "loragate.route.reason": decision.reason,
        "loragate.route.predicted_cached_tokens": decision.predicted_cached_tokens,
        "loragate.route.adapter_tier": decision.adapter_tier.value,
        "loragate.route.candidates": len(decision.candidates),
    }
    for scorer, per_worker in decision.scores.items():
        if decision.worker_id in per_worker:
            attrs[f"loragate.route.score.{scorer}"] = per_worker[decision.worker_id]
    return attrs
