"""The profile: filters → weighted, clamped scorers → picker, and the decision it returns per outcome."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from loragate.contracts import AdapterTier
from policies.filters.queue_bound import QueueBound
from policies.filters.serves_model import ServesModel
from policies.framework import PolicyError, Profile, Scorer
from policies.pickers.maximum import MaxPicker
from policies.scorers.prefix import PrefixScorer
from policies.types import Candidate, Outcome, RouteRequest
from tests.policies.factories import candidate, request


class Fixed(Scorer):
    """A scorer that returns preset scores, out of range on purpose."""

    type_name = "fixed"

    def __init__(self, name: str, scores: Sequence[float]):
        super().__init__(name)
        self.scores = list(scores)

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        return self.scores[: len(candidates)]


def profile(*scorers: tuple[Scorer, float]) -> Profile:
    bound = QueueBound("queue-bound", {"max_outstanding": 4})
    return Profile("p", (ServesModel("serves-model"), bound), tuple(scorers), MaxPicker("max"))


@pytest.mark.parametrize(
    ("candidates", "outcome", "worker"),
    [
        pytest.param([], Outcome.NO_WORKER, None, id="no candidates"),
        pytest.param([candidate("w1", outstanding=9)], Outcome.FILTERED_OUT, None, id="all filtered out"),
        pytest.param([candidate("w1"), candidate("w2", outstanding=9)], Outcome.SINGLE, "w1", id="one left"),
        pytest.param([candidate("w1"), candidate("w2", cached_blocks=2)], Outcome.ROUTED, "w2", id="scored"),
    ],
)
def test_route_outcomes(candidates: list[Candidate], outcome: Outcome, worker: str | None) -> None:
    decision = profile((PrefixScorer("prefix"), 1.0)).route(
        request(block_hashes=(1, 2)), candidates, random.Random(0), "d1"
    )
    assert (decision.outcome, decision.worker_id) == (outcome, worker)


def test_decision_reports_scores_totals_cache_and_tier() -> None:
    p = profile((PrefixScorer("prefix"), 3.0), (Fixed("fixed", [0.0, 1.0]), 1.0))
    req = request(block_hashes=(1, 2, 3, 4), adapter="tiny:a")
    cands = [candidate("w1", cached_blocks=4), candidate("w2", adapters_host=("tiny:a",))]
    d = p.route(req, cands, random.Random(0), "d1")
    assert d.worker_id == "w1" and d.profile == "p" and d.decision_id == "d1"
    assert d.scores == {"prefix": {"w1": 1.0, "w2": 0.0}, "fixed": {"w1": 0.0, "w2": 1.0}}
    assert d.totals == {"w1": pytest.approx(0.75), "w2": pytest.approx(0.25)}
    assert d.predicted_cached_tokens == 64 and d.adapter_tier is AdapterTier.DISK
    assert d.candidates == ("w1", "w2") and "w1" in d.reason


@pytest.mark.parametrize(
    ("raw", "clamped"),
    [
        pytest.param(7.0, 1.0, id="above 1"),
        pytest.param(-3.0, 0.0, id="below 0"),
        pytest.param(float("nan"), 0.0, id="NaN"),
    ],
)
def test_scores_are_clamped(raw: float, clamped: float) -> None:
    d = profile((Fixed("fixed", [raw, 0.5]), 1.0)).route(
        request(), [candidate("w1"), candidate("w2")], random.Random(0), "d"
    )
    assert d.scores["fixed"]["w1"] == clamped


def test_predicted_cached_tokens_never_exceed_the_prompt() -> None:
    d = profile().route(request(prompt_tokens=20), [candidate(cached_blocks=4)], random.Random(0), "d")
    assert d.predicted_cached_tokens == 20


def test_unknown_parameter_names_its_path() -> None:
    with pytest.raises(PolicyError) as e:
        QueueBound("queue-bound", {"max_outstandnig": 3})
    assert e.value.path == "parameters.max_outstandnig" and "max_outstanding" in e.value.message


def test_workers_dropped_only_by_availability_filters_mean_no_worker_not_busy() -> None:
    """All workers unable to serve (here: another model) is NO_WORKER (503), not FILTERED_OUT (429):
    retrying soon would not help."""
    d = profile().route(request(), [candidate("w1", model="small")], random.Random(0), "d")
    assert (d.outcome, d.worker_id) == (Outcome.NO_WORKER, None)
    assert d.reason == "all 1 workers were filtered out (serves-model: 1)"


def test_filtered_out_reason_counts_the_filter_that_dropped_each_worker() -> None:
    cands = [candidate("w1", outstanding=9), candidate("w2", model="small"), candidate("w3", outstanding=5)]
    d = profile().route(request(), cands, random.Random(0), "d")
    assert d.reason == "all 3 workers were filtered out (queue-bound: 2, serves-model: 1)"
    assert d.candidates == ("w1", "w2", "w3")
