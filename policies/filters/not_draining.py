"""`not-draining`: drop workers that are shutting down.

Algorithm: keep a candidate unless its heartbeat says `draining` (it finishes what it runs and admits
nothing new, so a request sent there would wait to be re-routed).

Parameters: none.
"""

from __future__ import annotations

from policies.framework import Filter
from policies.types import Candidate, RouteRequest


class NotDraining(Filter):
    type_name = "not-draining"

    def keep(self, request: RouteRequest, candidate: Candidate) -> bool:
        return not candidate.state.draining
