"""`tenant-allowed`: refuse every worker when the tenant may not use the request's adapter.

Algorithm: keep a candidate when the adapter is open to everyone (`request.allowed_tenants` empty) or the
request's tenant is among its tenants. The verdict is the same for every worker, so a forbidden request
ends FILTERED_OUT; the gateway normally refuses such a request earlier with 403, and this filter keeps
routing correct when it is called without that check (simulators, replays).

Parameters: none.
"""

from __future__ import annotations

from policies.framework import Filter
from policies.types import Candidate, RouteRequest


class TenantAllowed(Filter):
    type_name = "tenant-allowed"

    def keep(self, request: RouteRequest, candidate: Candidate) -> bool:
        return not request.allowed_tenants or request.tenant in request.allowed_tenants
