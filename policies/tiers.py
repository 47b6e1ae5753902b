"""Routing aliases: `model: "auto"` → a base model chosen by the request's difficulty and the fleet's load.

An alias lists tiers from the smallest model to the largest, each a score band:
`[{max_score: 0.4, model: tiny}, {max_score: 0.8, model: small}, {model: large}]` sends a request whose
difficulty score (`policies.difficulty`) is ≤ 0.4 to `tiny`, ≤ 0.8 to `small`, and the rest to `large`
(the last tier has no `max_score`: it takes everything above the others).

Saturation shift (`choose_tier`): when the chosen model's pool is saturated — its saturation, outstanding
requests over capacity (`pool_saturation`), is above `saturation_threshold` — the request moves one tier
down, provided that tier's pool is less saturated and the request's score is within `shift_margin` of
that lower band's `max_score` (so with a margin below 1 the hardest requests stay on the big model).
The big pool sheds its easiest traffic first instead of queueing everything.

Alias fields:
    tiers: the bands, ≥ 1, ascending `max_score` in [0, 1], the last without one.
    saturation_threshold: pool saturation above which requests shift down, ≥ 0 (default 0.85).
    shift_margin: how far above the lower band's `max_score` a score may be and still shift, in [0, 1]
        (default 1: every request of a saturated tier may shift).
    profile: the profile that routes among the chosen model's workers (default: the policy's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.types import Candidate


@dataclass(frozen=True)
class TierBand:
    model: str
    max_score: float | None = None  # None: the last, open-ended band


@dataclass(frozen=True)
class Alias:
    name: str
    tiers: tuple[TierBand, ...]
    saturation_threshold: float = 0.85
    shift_margin: float = 1.0
    profile: str | None = None

    @property
    def models(self) -> tuple[str, ...]:
        """The tiers' models, smallest first (`RouteRequest.tier_models`)."""
        return tuple(t.model for t in self.tiers)

    def band(self, score: float) -> int:
        """The index of the first tier whose band holds `score`."""
        for i, tier in enumerate(self.tiers):
            if tier.max_score is None or score <= tier.max_score:
                return i
        return len(self.tiers) - 1


def choose_tier(alias: Alias, score: float, saturation: Mapping[str, float]) -> tuple[str, str]:
    """(model, reason) for a request with difficulty `score`, given each model's pool saturation."""
    index = alias.band(score)
    model = alias.tiers[index].model
    load = saturation.get(model, 0.0)
    base = f"{alias.name}: difficulty {score:.2f} → {model}"
    if load <= alias.saturation_threshold:
        return model, base
    if index == 0:
        return model, f"{base} (saturated {load:.2f}, no smaller tier)"
    lower = alias.tiers[index - 1]
    lower_load = saturation.get(lower.model, 0.0)
    if lower_load >= load:
        return model, f"{base} (saturated {load:.2f}, {lower.model} is as busy: {lower_load:.2f})"
    if lower.max_score is not None and score > lower.max_score + alias.shift_margin:
        return model, f"{base} (saturated {load:.2f}, too hard to shift)"
    return lower.model, f"{base}, shifted to {lower.model}: {model} saturated {load:.2f}"


def pool_saturation(candidates: Iterable[Candidate], capacity: float) -> dict[str, float]:
    """Model → outstanding requests of its workers / (capacity × workers); `capacity` per worker, > 0."""
    outstanding: dict[str, int] = {}
    workers: dict[str, int] = {}
    for c in candidates:
        outstanding[c.state.model] = outstanding.get(c.state.model, 0) + c.outstanding
        workers[c.state.model] = workers.get(c.state.model, 0) + 1
    return {m: outstanding[m] / (capacity * workers[m]) for m in workers}
