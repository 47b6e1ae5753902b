"""The gateway's side of routing: turn a request and the fleet snapshot into the policy's inputs, run
the active profile (and the shadow one, if any), and keep the decision explainable.

Model aliases (`auto` or any alias in the policy) are resolved first: the policy's difficulty estimator
scores the request and `choose_tier` maps the score to a base model, stepping down a tier when that
model's pool is saturated. Candidates are every live worker serving the base, in worker-id order, each
with its outstanding requests and the prefix blocks it holds of this prompt (`PrefixIndex`, fed by the
workers' KV events, plus what this gateway routed where).
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass

from gateway.decisions import DecisionLog
from gateway.errors import APIError
from gateway.fleet import Fleet
from gateway.policy_store import PolicyHolder
from policies.alias_ladder import choose_rung, pool_saturation
from policies.difficulty import DifficultyQuery
from policies.document import Policy
from policies.prefix_index import PrefixIndex
from policies.types import Candidate, Outcome, RouteDecision, RouteRequest

SATURATION_CAPACITY = 32.0  # outstanding requests per worker that count as a full pool


@dataclass(frozen=True)
class AliasChoice:
    model: str
    score: float
    reason: str


class Router:
    def __init__(
        self,
        fleet: Fleet,
        holder: PolicyHolder[Policy],
        index: PrefixIndex,
        log: DecisionLog,
        seed: int | None = None,
    ):
        self.fleet, self.holder, self.index, self.log = fleet, holder, index, log
        self.rng = random.Random(seed)
        # Prompt tokens this gateway routed to each worker that have not produced a first token yet: the
        # prefill work queued ahead of a new request (the cost scorer's `queued_tokens`).
        self.queued_tokens: dict[str, int] = {}

    def is_alias(self, model: str) -> bool:
        return model in self.holder.policy.aliases

    def resolve_alias(self, model: str, text: str, max_tokens: int) -> AliasChoice:
        policy = self.holder.policy
        alias = policy.aliases[model]
        score = policy.estimator.score(DifficultyQuery(text=text, max_tokens=max_tokens))
        candidates = [self._candidate(w.state.worker_id, ()) for w in self.fleet.workers.values()]
        saturation = pool_saturation(candidates, SATURATION_CAPACITY)
        live = {c.state.model for c in candidates if not c.state.draining}
        chosen, reason = choose_rung(alias, score, saturation)
        if chosen not in live:  # a tier with no worker: take the nearest tier that has one
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

    def route(self, request: RouteRequest) -> RouteDecision:
        serving = sorted(
            w.state.worker_id for w in self.fleet.workers.values() if w.state.model == request.base
        )
        candidates = [self._candidate(wid, request.block_hashes) for wid in serving]
        decision_id = uuid.uuid4().hex[:16]
        decision = self.holder.policy.profile().route(request, candidates, self.rng, decision_id)
        shadow = self.holder.shadow
        if shadow is not None and decision.worker_id is not None:
            self.log.shadow.record(
                decision, shadow.profile().route(request, candidates, self.rng, decision_id)
            )
        if decision.outcome is Outcome.NO_WORKER:
            self.log.count(decision)
            raise APIError(
                503,
                f"No worker is serving '{request.base}' right now.",
                code="no_worker",
                headers={"Retry-After": "2"},
            )
        if decision.outcome is Outcome.FILTERED_OUT or decision.worker_id is None:
            self.log.count(decision)
            raise APIError(
                429,
                f"All workers serving '{request.base}' are at capacity; retry shortly. ({decision.reason})",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.fleet.note_enqueued(decision.worker_id)  # before any await: concurrent requests see it
        self.queued_tokens[decision.worker_id] = (
            self.queued_tokens.get(decision.worker_id, 0) + request.prompt_tokens
        )
        self.index.record_routed(decision.worker_id, request.block_hashes)
        return decision

    def prefill_done(self, worker_id: str, prompt_tokens: int) -> None:
        """The request's first token came back (or it failed): its prompt no longer waits on the worker."""
        left = self.queued_tokens.get(worker_id, 0) - prompt_tokens
        if left > 0:
            self.queued_tokens[worker_id] = left
        else:
            self.queued_tokens.pop(worker_id, None)

    def _candidate(self, worker_id: str, hashes: tuple[int, ...]) -> Candidate:
        view = self.fleet.workers[worker_id]
        cached = self.index.cached_blocks(worker_id, hashes) if hashes else 0
        return Candidate(view.state, view.queue_len, cached, self.queued_tokens.get(worker_id, 0))


def route_request(
    request_id: str,
    tenant: str,
    base: str,
    adapter: str | None,
    allowed: tuple[str, ...],
    prompt: list[int],
    max_tokens: int,
    hashes: list[int],
    block_size: int,
    text: str,
) -> RouteRequest:
    return RouteRequest(
        request_id=request_id,
        tenant=tenant,
        base=base,
        adapter=adapter,
        prompt_tokens=len(prompt),
        max_tokens=max_tokens,
        block_hashes=tuple(hashes),
        block_size=block_size,
        allowed_tenants=allowed,
        now=time.time(),
        prompt_text=text[:4000],
    )


def decision_attributes(decision: RouteDecision) -> dict[str, str | int | float]:
    """The decision as span attributes: chosen worker, each scorer's score for it, prediction, tier."""
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
