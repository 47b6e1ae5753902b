"""`tenant-allowed`: an adapter open to all, or one listing the request's tenant."""

from __future__ import annotations

import pytest

from policies.filters.tenant_allowed import TenantAllowed
from tests.policies.factories import candidate, request


@pytest.mark.parametrize(
    ("allowed", "kept"),
    [
        pytest.param((), True, id="open to every tenant"),
        pytest.param(("t0", "t1"), True, id="tenant listed"),
        pytest.param(("t0",), False, id="tenant not listed"),
    ],
)
def test_tenant_allowed(allowed: tuple[str, ...], kept: bool) -> None:
    assert TenantAllowed("tenant-allowed").keep(request(allowed_tenants=allowed), candidate()) is kept
