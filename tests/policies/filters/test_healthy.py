"""`healthy`: heartbeat age within `max_age_s`, unchecked without a clock."""

from __future__ import annotations

import pytest

from policies.filters.healthy import Healthy
from policies.framework import PolicyError
from tests.policies.factories import candidate, request


@pytest.mark.parametrize(
    ("now", "updated_at", "kept"),
    [
        pytest.param(0.0, 1.0, True, id="no clock: keep"),
        pytest.param(1004.0, 1000.0, True, id="fresh heartbeat"),
        pytest.param(1005.0, 1000.0, True, id="exactly max age"),
        pytest.param(1006.0, 1000.0, False, id="stale heartbeat"),
    ],
)
def test_healthy(now: float, updated_at: float, kept: bool) -> None:
    f = Healthy("healthy", {"max_age_s": 5})
    assert f.keep(request(now=now), candidate(updated_at=updated_at)) is kept


def test_negative_max_age_is_rejected() -> None:
    with pytest.raises(PolicyError) as e:
        Healthy("healthy", {"max_age_s": -1})
    assert e.value.path == "parameters.max_age_s"
