"""`difficulty`: when the candidates span several base models, prefer the one the request's difficulty suits.

Algorithm: an alias (e.g. `auto`) lists its models from smallest to largest (`request.ladder_models`)
and the difficulty estimator's band picked a rung (`request.target_rung`, see `policies.alias_ladder`).
A candidate on rung `r` scores `1 - |r - target| / (n - 1)`: 1 on the chosen model, less the further away
its model is, so load and cost scorers can still move a request one rung when the chosen pool is busy. A
candidate whose model is not on the ladder scores 0; a request without a ladder (a plain model, or one
rung) scores 1 everywhere, so the scorer is neutral.

Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.framework import Scorer
from policies.types import Candidate, RouteRequest


class DifficultyScorer(Scorer):
    type_name = "difficulty"

    def score_one(self, request: RouteRequest, candidate: Candidate) -> float:
        ladder = request.ladder_models
        if request.target_rung is None or len(ladder) < 2:
            return 1.0
        if candidate.state.model not in ladder:
            return 0.0
        rung = ladder.index(candidate.state.model)
        return 1.0 - abs(rung - request.target_rung) / (len(ladder) - 1)

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [self.score_one(request, c) for c in candidates]
