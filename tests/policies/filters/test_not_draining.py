"""`not-draining`: a draining worker takes nothing new."""

from __future__ import annotations

import pytest

from policies.filters.not_draining import NotDraining
from tests.policies.factories import candidate, request


@pytest.mark.parametrize(
    ("draining", "kept"),
    [pytest.param(False, True, id="serving"), pytest.param(True, False, id="draining")],
)
def test_not_draining(draining: bool, kept: bool) -> None:
    assert NotDraining("not-draining").keep(request(), candidate(draining=draining)) is kept
