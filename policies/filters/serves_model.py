"""`serves-model`: keep the workers whose base model can serve the request.

Algorithm: keep a candidate when its model is the request's resolved base model, or, when the request
routes an alias over several base models at once, one of the models on the alias's ladder
(`request.ladder_models`).

Parameters: none.
"""

from __future__ import annotations

from policies.framework import Filter
from policies.types import Candidate, RouteRequest


class ServesModel(Filter):
    type_name = "serves-model"

    def keep(self, request: RouteRequest, candidate: Candidate) -> bool:
        model = candidate.state.model
        return model == request.base or model in request.ladder_models
