"""`serves-model`: the request's base model, or any model of the alias ladder it routes over."""

from __future__ import annotations

from typing import Any

import pytest

from policies.filters.serves_model import ServesModel
from tests.policies.factories import candidate, request


@pytest.mark.parametrize(
    ("req", "model", "kept"),
    [
        pytest.param({}, "tiny", True, id="same base model"),
        pytest.param({}, "small", False, id="other base model"),
        pytest.param(
            {"base": "tiny", "ladder_models": ("tiny", "small")}, "small", True, id="on the alias ladder"
        ),
    ],
)
def test_serves_model(req: dict[str, Any], model: str, kept: bool) -> None:
    assert ServesModel("serves-model").keep(request(**req), candidate(model=model)) is kept
