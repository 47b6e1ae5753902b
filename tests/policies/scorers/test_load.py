"""`load`: weighted queue, running and free-KV headroom."""

from __future__ import annotations

from typing import Any

import pytest

from policies.framework import PolicyError
from policies.scorers.load import LoadScorer
from tests.policies.factories import candidate, request

# equal weights, so each term moves the score by a third
PARAMS = {"capacity": 10, "max_running": 4, "queue_weight": 1, "running_weight": 1, "kv_weight": 1}


@pytest.mark.parametrize(
    ("cand", "expected"),
    [
        pytest.param({}, 1.0, id="idle with free KV"),
        pytest.param({"outstanding": 5, "running": 2, "kv_blocks_free": 50}, 0.5, id="half busy everywhere"),
        pytest.param({"outstanding": 50, "running": 9, "kv_blocks_free": 0}, 0.0, id="over capacity clamps"),
        pytest.param({"kv_blocks_free": 0, "kv_blocks_total": 0}, 1.0, id="unknown KV size counts as free"),
    ],
)
def test_load(cand: dict[str, Any], expected: float) -> None:
    assert LoadScorer("load", PARAMS).score(request(), [candidate(**cand)]) == [pytest.approx(expected)]


def test_all_zero_weights_are_rejected() -> None:
    with pytest.raises(PolicyError) as e:
        LoadScorer("load", {"queue_weight": 0, "running_weight": 0, "kv_weight": 0})
    assert e.value.path == "parameters.queue_weight"
