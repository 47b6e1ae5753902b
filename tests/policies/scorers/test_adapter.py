"""`adapter`: 1 / (1 + load cost / scale) by the adapter's tier; neutral without an adapter."""

from __future__ import annotations

from typing import Any

import pytest

from policies.framework import PolicyError
from policies.scorers.adapter import AdapterScorer
from tests.policies.factories import candidate, request

PARAMS = {"device_s": 0.0, "host_s": 0.01, "disk_s": 0.03, "scale_s": 0.01}


@pytest.mark.parametrize(
    ("adapter", "cand", "expected"),
    [
        pytest.param(None, {}, 1.0, id="no adapter: neutral"),
        pytest.param("tiny:a", {"adapters_device": ("tiny:a",)}, 1.0, id="on device"),
        pytest.param("tiny:a", {"adapters_host": ("tiny:a",)}, 0.5, id="in host memory"),
        pytest.param("tiny:a", {}, 0.25, id="on disk"),
    ],
)
def test_adapter(adapter: str | None, cand: dict[str, Any], expected: float) -> None:
    scores = AdapterScorer("adapter", PARAMS).score(request(adapter=adapter), [candidate(**cand)])
    assert scores == [pytest.approx(expected)]


def test_zero_scale_is_rejected() -> None:
    with pytest.raises(PolicyError) as e:
        AdapterScorer("adapter", {"scale_s": 0})
    assert e.value.path == "parameters.scale_s"
