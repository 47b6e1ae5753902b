"""Routing aliases: `model: "auto"` → a base model chosen by the request's difficulty and the fleet's load.

An alias is a ladder of models from the smallest to the largest; each rung takes a band of difficulty
scores: `rungs: [{max_score: 0.4, model: tiny}, {max_score: 0.8, model: small}, {model: large}]` sends a
request whose difficulty score (`policies.difficulty`) is ≤ 0.4 to `tiny`, ≤ 0.8 to `small`, and the rest
to `large` (the last, top rung has no `max_score`: it takes everything above the others). "Rung" is the
alias's word only: where an adapter lives (device, host, disk) is its tier (`loragate.contracts.AdapterTier`).

Saturation shift (`choose_rung`): when the chosen model's pool is saturated — its saturation, outstanding
requests over capacity (`pool_saturation`), is above `saturation_threshold` — the request moves one rung
down, provided that rung's pool is less saturated and the request's score is within `shift_margin` of
that lower band's `max_score` (so with a margin below 1 the hardest requests stay on the big model).
The big pool sheds its easiest traffic first instead of queueing everything.

Alias fields:
    rungs: the bands, ≥ 1, ascending `max_score` in [0, 1], the last without one (the policy document
        still reads the field's old name, `tiers`, for documents stored before the rename).
    saturation_threshold: pool saturation above which requests shift down, ≥ 0 (default 0.85).
    shift_margin: how far above the lower band's `max_score` a score may be and still shift, in [0, 1]
        (default 1: every request of a saturated rung may shift).
    profile: the profile that routes among the chosen model's workers (default: the policy's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.types import Candidate


@dataclass(frozen=True)
class Rung:
    model: str
    max_score: float | None = None  # None: the top rung, open-ended


@dataclass(frozen=True)
class Alias:
    name: str
    rungs: tuple[Rung, ...]
    saturation_threshold: float = 0.85
    shift_margin: float = 1.0
    profile: str | None = None

    @property
    def models(self) -> tuple[str, ...]:
        """The rungs' models, smallest first (`RouteRequest.ladder_models`)."""
        return tuple(r.model for r in self.rungs)

    def band(self, score: float) -> int:
        """The index of the first rung whose band holds `score`."""
        for i, rung in enumerate(self.rungs):
            if rung.max_score is None or score <= rung.max_score:
                return i
        return len(self.rungs) - 1


def choose_rung(alias: Alias, score: float, saturation: Mapping[str, float]) -> tuple[str, str]:
    """(model, reason) for a request with difficulty `score`, given each model's pool saturation."""
    index = alias.band(score)
    model = alias.rungs[index].model
    load = saturation.get(model, 0.0)
    base = f"{alias.name}: difficulty {score:.2f} → {model}"
    if load <= alias.saturation_threshold:
        return model, base
    if index == 0:
        return model, f"{base} (saturated {load:.2f}, no smaller rung)"
    lower = alias.rungs[index - 1]
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
