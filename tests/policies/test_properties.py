"""Properties over random fleets and requests: scores in [0, 1], pickers return a valid index, profiles
are deterministic given a seeded random source, and routing never picks a filtered-out worker."""

from __future__ import annotations

import copy
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from loragate.messages import WorkerState
from policies.default_policy import DEFAULT_POLICY
from policies.difficulty import DifficultyQuery, HeuristicEstimator
from policies.document import parse_policy
from policies.framework import Picker, Scorer
from policies.plugin_types import PLUGIN_TYPES
from policies.types import Candidate, Outcome, RouteRequest

MODELS = ("tiny", "small")
ADAPTERS = ("tiny:a", "tiny:b", "small:a")
POLICY = parse_policy(copy.deepcopy(DEFAULT_POLICY))
SCORERS = [cls(name) for name, cls in PLUGIN_TYPES.items() if issubclass(cls, Scorer)]
PICKERS = [cls(name) for name, cls in PLUGIN_TYPES.items() if issubclass(cls, Picker)]

counts = st.integers(min_value=0, max_value=500)
rates = st.one_of(st.just(0.0), st.floats(min_value=1.0, max_value=1e5))


@st.composite
def states(draw: st.DrawFn, worker_id: str) -> WorkerState:
    total = draw(counts)
    return WorkerState(
        worker_id,
        draw(st.sampled_from(MODELS)),
        "/m",
        2048,
        adapters_device=tuple(draw(st.lists(st.sampled_from(ADAPTERS), max_size=2, unique=True))),
        adapters_host=tuple(draw(st.lists(st.sampled_from(ADAPTERS), max_size=2, unique=True))),
        kv_blocks_free=draw(st.integers(min_value=0, max_value=total)),
        kv_blocks_total=total,
        running=draw(counts),
        waiting=draw(counts),
        draining=draw(st.booleans()),
        prefill_tok_s=draw(rates),
        updated_at=draw(st.floats(min_value=990.0, max_value=1000.0)),
    )


@st.composite
def fleets(draw: st.DrawFn, min_size: int = 0) -> list[Candidate]:
    n = draw(st.integers(min_value=min_size, max_value=6))
    return [
        Candidate(draw(states(f"w{i}")), draw(counts), draw(st.integers(0, 40)), draw(counts))
        for i in range(n)
    ]


@st.composite
def requests(draw: st.DrawFn) -> RouteRequest:
    blocks = draw(st.integers(min_value=0, max_value=20))
    ladder = draw(st.sampled_from([(), MODELS]))
    return RouteRequest(
        "r",
        draw(st.sampled_from(("t1", "t2"))),
        draw(st.sampled_from(MODELS)),
        draw(st.one_of(st.none(), st.sampled_from(ADAPTERS))),
        prompt_tokens=draw(st.integers(min_value=0, max_value=4000)),
        max_tokens=draw(st.integers(min_value=0, max_value=4000)),
        block_hashes=tuple(range(1, blocks + 1)),
        allowed_tenants=draw(st.sampled_from([(), ("t1",)])),
        now=draw(st.sampled_from([0.0, 1000.0, 1003.0])),
        ladder_models=ladder,
        target_rung=draw(st.sampled_from([None, 0, 1])) if ladder else None,
    )


@settings(max_examples=150, deadline=None)
@given(requests(), fleets(min_size=1))
def test_every_scorer_scores_in_unit_interval(request: RouteRequest, fleet: list[Candidate]) -> None:
    for scorer in SCORERS:
        scores = scorer.score(request, fleet)
        assert len(scores) == len(fleet) and all(0.0 <= s <= 1.0 for s in scores), scorer.name


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=8), st.integers(0, 2**32))
def test_every_picker_returns_a_valid_index(totals: list[float], seed: int) -> None:
    for picker in PICKERS:
        assert 0 <= picker.pick(totals, random.Random(seed)) < len(totals), picker.name


@settings(max_examples=100, deadline=None)
@given(requests(), fleets(), st.integers(0, 2**32), st.sampled_from(["default", "least-loaded", "random"]))
def test_profiles_are_deterministic_given_a_seed(
    request: RouteRequest, fleet: list[Candidate], seed: int, name: str
) -> None:
    profile = POLICY.profile(name)
    first = profile.route(request, fleet, random.Random(seed), "d")
    assert profile.route(request, fleet, random.Random(seed), "d") == first


@settings(max_examples=100, deadline=None)
@given(requests(), fleets())
def test_routing_picks_a_worker_that_passed_every_filter(
    request: RouteRequest, fleet: list[Candidate]
) -> None:
    profile = POLICY.profile()
    decision = profile.route(request, fleet, random.Random(0), "d")
    passing = [c for c in fleet if all(f.keep(request, c) for f in profile.filters)]
    if passing:
        assert decision.worker_id in {c.worker_id for c in passing}
        assert decision.outcome in (Outcome.ROUTED, Outcome.SINGLE)
        assert all(0.0 <= t <= 1.0 for t in decision.totals.values())
    else:
        assert decision.worker_id is None


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400), st.integers(0, 10_000), st.integers(0, 10_000))
def test_difficulty_scores_in_unit_interval(text: str, max_tokens: int, prompt_tokens: int) -> None:
    assert 0.0 <= HeuristicEstimator().score(DifficultyQuery(text, max_tokens, prompt_tokens)) <= 1.0
