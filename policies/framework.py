"""The plugin interfaces and the profile that runs them: filters → weighted scorers → picker.

A `Filter` drops candidates, a `Scorer` gives every remaining candidate a score in [0, 1] (the profile
clamps, so a faulty scorer cannot dominate), and a `Picker` chooses one from the weighted totals
`Σ wᵢ·sᵢ / Σ wᵢ`. Plugins are constructed from the policy document (type, name, parameters) and are
immutable; a profile is a pure function of (request, candidates, random source).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policies.types import Candidate, Outcome, RouteDecision, RouteRequest


class PolicyError(ValueError):
    """An invalid policy document; `path` names the offending field (e.g. `plugins[2].parameters.k`)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


class Plugin(ABC):
    """Base of all plugins: `type_name` is what the policy document's `type` field says."""

    type_name: ClassVar[str]
    kind: ClassVar[str]  # "filter" | "scorer" | "picker"
    parameter_names: ClassVar[frozenset[str]] = frozenset()  # the keys `parameters` may hold

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        self.name = name
        self.parameters = dict(parameters or {})
        for key in self.parameters:
            if key not in self.parameter_names:
                expected = ", ".join(sorted(self.parameter_names)) or "none"
                raise PolicyError(
                    f"parameters.{key}", f"unknown parameter of {self.type_name!r} ({expected})"
                )

    def param(self, key: str, default: float, lo: float = float("-inf"), hi: float = float("inf")) -> float:
        value = self.parameters.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise PolicyError(f"parameters.{key}", f"must be a number in [{lo}, {hi}], got {value!r}")
        return float(value)


class Filter(Plugin):
    """Drops candidates that must not get the request. A *capacity* filter drops a worker that is busy
    now and will take work again soon (the request may be retried: 429); any other drops a worker that
    cannot serve the request (unhealthy, draining, wrong model: 503 when no worker is left)."""

    kind = "filter"
    capacity: ClassVar[bool] = False

    @abstractmethod
    def keep(self, request: RouteRequest, candidate: Candidate) -> bool: ...


class Scorer(Plugin):
    kind = "scorer"

    @abstractmethod
    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """One score per candidate, in the candidates' order; higher is better."""


class Picker(Plugin):
    kind = "picker"

    @abstractmethod
    def pick(self, totals: Sequence[float], rng: random.Random) -> int:
        """The index of the chosen candidate (there is at least one)."""


@dataclass(frozen=True)
class Profile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker

    def route(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random, decision_id: str
    ) -> RouteDecision:
        if not candidates:
            return RouteDecision(
                decision_id, self.name, Outcome.NO_WORKER, None, f"no worker serves {request.base!r}"
            )
        kept = [c for c in candidates if all(f.keep(request, c) for f in self.filters)]
        if not kept:
            first_drop = Counter(
                next(f.name for f in self.filters if not f.keep(request, c)) for c in candidates
            )
            dropped = ", ".join(f"{name}: {n}" for name, n in first_drop.most_common())
            busy = any(f.capacity and first_drop[f.name] for f in self.filters)
            return RouteDecision(
                decision_id,
                self.name,
                Outcome.FILTERED_OUT if busy else Outcome.NO_WORKER,
                None,
                f"all {len(candidates)} workers were filtered out ({dropped})",
                candidates=tuple(c.worker_id for c in candidates),
            )
        scores: dict[str, dict[str, float]] = {}
        totals = [0.0] * len(kept)
        weight_sum = sum(w for _, w in self.scorers) or 1.0
        for scorer, weight in self.scorers:
            raw = scorer.score(request, kept)
            clamped = [min(1.0, max(0.0, s)) if s == s else 0.0 for s in raw]  # NaN counts as 0
            scores[scorer.name] = {c.worker_id: s for c, s in zip(kept, clamped, strict=True)}
            totals = [t + weight * s / weight_sum for t, s in zip(totals, clamped, strict=True)]
        index = 0 if len(kept) == 1 else self.picker.pick(totals, rng)
        chosen = kept[index]
        outcome = Outcome.SINGLE if len(kept) == 1 else Outcome.ROUTED
        top = max(scores, key=lambda n: scores[n][chosen.worker_id], default="")
        reason = f"{chosen.worker_id}: total {totals[index]:.3f}" + (f", best on {top}" if top else "")
        return RouteDecision(
            decision_id,
            self.name,
            outcome,
            chosen.worker_id,
            reason,
            scores,
            {c.worker_id: t for c, t in zip(kept, totals, strict=True)},
            predicted_cached_tokens=min(request.prompt_tokens, chosen.cached_blocks * request.block_size),
            adapter_tier=chosen.tier(request.adapter),
            candidates=tuple(c.worker_id for c in kept),
        )
