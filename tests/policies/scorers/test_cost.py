"""`cost`: predicted TTFT = queue wait + adapter load + uncached prefill; score = fastest / own."""

from __future__ import annotations

from typing import Any

import pytest

from policies.scorers.cost import CostScorer
from tests.policies.factories import candidate, request

PARAMS = {"request_s": 0.1, "default_prefill_tok_s": 1000, "device_s": 0, "host_s": 0.05, "disk_s": 0.5}


@pytest.mark.parametrize(
    ("req", "cand", "ttft"),
    [
        pytest.param({}, {}, 0.1, id="idle: uncached prefill at the default rate"),
        pytest.param({}, {"prefill_tok_s": 500.0}, 0.2, id="measured prefill rate"),
        pytest.param({}, {"outstanding": 3}, 0.4, id="queue wait from outstanding requests"),
        pytest.param({}, {"outstanding": 3, "queued_tokens": 200}, 0.3, id="queue wait from queued tokens"),
        pytest.param({}, {"outstanding": 3, "queued_tokens": 0}, 0.1, id="known empty queue: no wait"),
        pytest.param({"adapter": "tiny:a"}, {}, 0.6, id="adapter loaded from disk"),
        pytest.param(
            {"adapter": "tiny:a"}, {"adapters_host": ("tiny:a",)}, 0.15, id="adapter in host memory"
        ),
        pytest.param({"block_hashes": (1, 2, 3)}, {"cached_blocks": 3}, 0.052, id="cached prefix"),
        pytest.param({"prompt_tokens": 10}, {"cached_blocks": 3}, 0.0, id="cache beyond the prompt"),
    ],
)
def test_predicted_ttft(req: dict[str, Any], cand: dict[str, Any], ttft: float) -> None:
    assert CostScorer("cost", PARAMS).predicted_ttft(request(**req), candidate(**cand)) == pytest.approx(ttft)


def test_score_is_relative_to_the_fastest() -> None:
    scorer = CostScorer("cost", {**PARAMS, "floor_s": 1e-9})
    scores = scorer.score(request(), [candidate("fast"), candidate("slow", outstanding=1)])
    assert scores == [pytest.approx(1.0), pytest.approx(0.5)]
