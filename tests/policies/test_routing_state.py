"""The routing state: a reservation gives back what it holds exactly once on every path, a move takes it
along, an observation keeps the changes made while it was in flight, and routing builds candidates and
reserves the chosen worker the way both the gateway and the simulator rely on."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from loragate.contracts import AdapterTier
from loragate.messages import WorkerState
from policies.default_policy import DEFAULT_POLICY
from policies.document import parse_policy
from policies.routing_state import (
    PROMPT_TEXT_LIMIT,
    Phase,
    Reservation,
    RoutingState,
    WorkerView,
    make_route_request,
)
from policies.types import Candidate, Outcome, RouteDecision, RouteRequest
from tests.policies.factories import request

PROMPT = 100


def view(worker_id: str, outstanding: int, model: str = "tiny", draining: bool = False) -> WorkerView:
    return WorkerView(WorkerState(worker_id, model, "/m", 2048, draining=draining), outstanding)


def fleet(**outstanding: int) -> RoutingState:
    state = RoutingState()
    state.observe({w: view(w, n) for w, n in outstanding.items()})
    return state


def load(state: RoutingState) -> dict[str, int]:
    return {w: v.queue_len for w, v in state.workers.items()}


class Pick:
    """A profile that chooses a fixed worker (None: nobody) and remembers the candidates it saw."""

    def __init__(self, worker_id: str | None):
        self.worker_id = worker_id
        self.seen: list[Candidate] = []

    def route(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random, decision_id: str
    ) -> RouteDecision:
        self.seen = list(candidates)
        outcome = Outcome.ROUTED if self.worker_id else Outcome.FILTERED_OUT
        return RouteDecision(decision_id, "pick", outcome, self.worker_id, "test")


# -- the reservation lifecycle ---------------------------------------------------------------------
# Steps on one reservation routed to w1 (another request's 40 prompt tokens are queued on w1 too, so a
# double release would show), then what w1/w2 hold and what each `release` returned.
LIFECYCLES = [
    ("success", ["commit", "first_token", "release"], {"w1": 0, "w2": 0}, {"w1": 40}, [True]),
    ("error before the first token", ["commit", "release"], {"w1": 0, "w2": 0}, {"w1": 40}, [True]),
    ("disconnect while queued", ["commit", "release"], {"w1": 0, "w2": 0}, {"w1": 40}, [True]),
    ("copy queued first (never committed)", ["release"], {"w1": 0, "w2": 0}, {"w1": 40}, [True]),
    ("release twice", ["commit", "release", "release"], {"w1": 0, "w2": 0}, {"w1": 40}, [True, False]),
    ("first token twice", ["commit", "first_token", "first_token"], {"w1": 1, "w2": 0}, {"w1": 40}, []),
    ("commit twice", ["commit", "commit"], {"w1": 1, "w2": 0}, {"w1": 140}, []),
    ("in flight", ["commit"], {"w1": 1, "w2": 0}, {"w1": 140}, []),
    ("commit after release", ["release", "commit", "first_token"], {"w1": 0, "w2": 0}, {"w1": 40}, [True]),
    ("moved while queued", ["commit", "move", "release"], {"w1": 0, "w2": 0}, {"w1": 40}, [True]),
    ("moved, still queued", ["commit", "move"], {"w1": 0, "w2": 1}, {"w1": 40, "w2": 100}, []),
    ("moved after the first token", ["first_token", "move"], {"w1": 0, "w2": 1}, {"w1": 40}, []),
    ("moved after release", ["release", "move"], {"w1": 0, "w2": 0}, {"w1": 40}, [True]),
]


@pytest.mark.parametrize(
    ("steps", "outstanding", "queued", "releases"),
    [case[1:] for case in LIFECYCLES],
    ids=[case[0] for case in LIFECYCLES],
)
def test_reservation_lifecycle(
    steps: list[str], outstanding: dict[str, int], queued: dict[str, int], releases: list[bool]
) -> None:
    state = fleet(w1=0, w2=0)
    state.queue_tokens("w1", 40)
    reservation = state.reserve("w1", PROMPT)
    returned = []
    for step in steps:
        if step == "move":
            reservation.move("w2")
        elif step == "release":
            returned.append(reservation.release())
        else:
            getattr(reservation, step)()
    assert load(state) == outstanding
    assert state.queued_tokens == queued
    assert returned == releases


@pytest.mark.parametrize(
    ("steps", "phase"),
    [
        ([], Phase.ROUTED),
        (["commit"], Phase.QUEUED),
        (["commit", "first_token"], Phase.PREFILLED),
        (["move"], Phase.QUEUED),
        (["commit", "release", "commit"], Phase.RELEASED),
        (["release", "first_token"], Phase.RELEASED),
    ],
    ids=["routed", "queued", "prefilled", "moved means queued", "released stays", "no first token after"],
)
def test_phase_after(steps: list[str], phase: Phase) -> None:
    reservation = fleet(w1=0, w2=0).reserve("w1", PROMPT)
    for step in steps:
        reservation.move("w2") if step == "move" else getattr(reservation, step)()
    assert reservation.phase is phase


def test_every_path_releases_exactly_once_across_many_reservations() -> None:
    state = fleet(w1=3, w2=0)
    paths = [["commit", "first_token", "release"], ["release"], ["commit", "release", "release"]] * 5
    reservations = [state.reserve("w1", 10) for _ in paths]
    assert load(state)["w1"] == 3 + len(paths)
    for reservation, steps in zip(reservations, paths, strict=True):
        for step in steps:
            getattr(reservation, step)()
    assert load(state) == {"w1": 3, "w2": 0}
    assert state.queued_tokens == {}


# -- observations and this router's changes meanwhile ----------------------------------------------
# (changes before the mark, changes after it, the outstanding count the observation saw) -> w1's load.
RACES = [
    ("nothing noted", [], [], 5, 5),
    ("enqueued while the refresh was in flight", [], ["+"], 5, 6),
    ("two enqueues and an end in flight", [], ["+", "+", "-"], 5, 6),
    ("enqueued before the refresh started (it saw it)", ["+"], [], 5, 5),
    ("ended before the refresh started", ["-"], [], 4, 4),
    ("ended while in flight", [], ["-"], 5, 4),
    ("before and after", ["+", "+"], ["-"], 7, 6),
    ("never below zero", [], ["-", "-"], 1, 0),
]


@pytest.mark.parametrize(
    ("before", "during", "seen", "expected"), [c[1:] for c in RACES], ids=[c[0] for c in RACES]
)
def test_observation_keeps_the_changes_made_while_in_flight(
    before: list[str], during: list[str], seen: int, expected: int
) -> None:
    state = fleet(w1=5)
    note = {"+": state.note_enqueued, "-": state.note_ended}
    for change in before:
        note[change]("w1")
    mark = state.mark()
    for change in during:
        note[change]("w1")
    state.observe({"w1": view("w1", seen)}, mark)
    assert load(state) == {"w1": expected}


def test_a_change_is_applied_by_one_observation_only() -> None:
    state = fleet(w1=5)
    mark = state.mark()
    state.note_enqueued("w1")
    state.observe({"w1": view("w1", 5)}, mark)  # in flight: the enqueue is added
    assert load(state) == {"w1": 6}
    state.observe({"w1": view("w1", 6)}, state.mark())  # the next one saw it in Redis: not added again
    assert load(state) == {"w1": 6}


def test_an_observation_without_mark_is_taken_as_instant() -> None:
    state = fleet(w1=5)
    state.note_enqueued("w1")
    state.observe({"w1": view("w1", 9)})
    assert load(state) == {"w1": 9}


@pytest.mark.parametrize(
    ("keep_missing", "expected"), [(False, {"w2": 1}), (True, {"w1": 5, "w2": 1})], ids=["drop", "keep"]
)
def test_workers_an_observation_did_not_see(keep_missing: bool, expected: dict[str, int]) -> None:
    state = fleet(w1=5, w2=0)
    state.observe({"w2": view("w2", 1)}, keep_missing=keep_missing)
    assert load(state) == expected


def test_a_reservation_routed_during_a_refresh_survives_it() -> None:
    state = fleet(w1=0)
    mark = state.mark()
    reservation = state.reserve("w1", PROMPT)  # routed while the refresh awaited Redis
    state.observe({"w1": view("w1", 0)}, mark)  # XLEN did not see it yet
    assert load(state) == {"w1": 1}
    reservation.release()
    state.observe({"w1": view("w1", 0)}, state.mark())
    assert load(state) == {"w1": 0}


# -- candidates and routing ------------------------------------------------------------------------
def test_candidates_are_the_bases_workers_in_id_order() -> None:
    state = RoutingState()
    state.observe({w: view(w, 0) for w in ("w2", "w10", "w1")} | {"x": view("x", 0, model="other")})
    assert [c.worker_id for c in state.candidates("tiny")] == ["w1", "w10", "w2"]
    assert {c.worker_id for c in state.candidates(None)} == {"w1", "w2", "w10", "x"}


@pytest.mark.parametrize(
    ("count_queued_tokens", "expected"), [(True, [PROMPT, 0]), (False, [None, None])], ids=["counted", "off"]
)
def test_candidates_see_the_queued_prompt_tokens(
    count_queued_tokens: bool, expected: list[int | None]
) -> None:
    state = RoutingState(count_queued_tokens=count_queued_tokens)
    state.observe({"w1": view("w1", 0), "w2": view("w2", 0)})
    state.reserve("w1", PROMPT)
    assert [c.queued_tokens for c in state.candidates("tiny")] == expected


def test_route_reserves_the_chosen_worker_and_records_its_blocks() -> None:
    state = fleet(w1=2, w2=0)
    routed = state.route(Pick("w2"), request(block_hashes=(7, 8)), random.Random(0), "d1")
    assert isinstance(routed.reservation, Reservation) and routed.reservation.worker_id == "w2"
    assert routed.decision.decision_id == "d1"
    assert load(state) == {"w1": 2, "w2": 1}
    assert state.queued_tokens == {"w2": PROMPT}
    assert [c.cached_blocks for c in state.candidates("tiny", (7, 8))] == [0, 2]


@pytest.mark.parametrize("record_routed", [True, False], ids=["recorded", "events only"])
def test_record_routed_can_be_off(record_routed: bool) -> None:
    state = RoutingState(record_routed=record_routed)
    state.observe({"w1": view("w1", 0)})
    state.route(Pick("w1"), request(block_hashes=(7,)), random.Random(0), "d1")
    assert state.index.cached_blocks("w1", (7,)) == int(record_routed)


def test_no_worker_chosen_reserves_nothing_and_runs_no_shadow() -> None:
    state, shadow = fleet(w1=2), Pick("w1")
    routed = state.route(Pick(None), request(block_hashes=(7,)), random.Random(0), "d1", shadow)
    assert routed.reservation is None and routed.shadow is None and shadow.seen == []
    assert load(state) == {"w1": 2} and state.queued_tokens == {}
    assert state.index.cached_blocks("w1", (7,)) == 0


def test_shadow_routes_on_the_same_candidates_before_the_reservation() -> None:
    state, active, shadow = fleet(w1=2, w2=0), Pick("w2"), Pick("w1")
    routed = state.route(active, request(), random.Random(0), "d1", shadow)
    assert routed.shadow is not None and routed.shadow.worker_id == "w1"
    assert shadow.seen == active.seen and [c.outstanding for c in shadow.seen] == [2, 0]


def test_serving_leaves_out_draining_workers_and_other_models() -> None:
    state = RoutingState()
    state.observe({"a": view("a", 0), "b": view("b", 0, draining=True), "c": view("c", 0, model="big")})
    assert [w.state.worker_id for w in state.serving("tiny")] == ["a"]
    assert set(state.models()) == {"tiny", "big"}


def test_make_route_request_keeps_what_routing_reads() -> None:
    made = make_route_request(
        request_id="r",
        tenant="t",
        base="tiny",
        adapter=None,
        prompt_tokens=3,
        max_tokens=4,
        block_hashes=[1, 2],
        block_size=16,
        now=5.0,
        prompt_text="x" * (PROMPT_TEXT_LIMIT + 10),
    )
    assert made.block_hashes == (1, 2) and made.now == 5.0 and made.allowed_tenants == ()
    assert made.prompt_text == "x" * PROMPT_TEXT_LIMIT


# -- adapters routed but not yet reported ----------------------------------------------------------


def test_a_routed_adapter_is_pending_on_its_worker_until_its_requests_end() -> None:
    state = fleet(w1=0, w2=0)  # the heartbeats: no adapter anywhere
    pick = Pick("w2")
    burst = [request(adapter="a")] * 2 + [request(adapter="b")]
    routed = [state.route(pick, r, random.Random(0), f"d{i}") for i, r in enumerate(burst)]
    state.route(pick, request(adapter="c"), random.Random(0), "probe")
    by_worker = {c.worker_id: c for c in pick.seen}
    assert by_worker["w2"].pending_adapters == {"a", "b"} and by_worker["w1"].pending_adapters == set()
    assert by_worker["w2"].tier("a") is AdapterTier.DEVICE and by_worker["w1"].tier("a") is AdapterTier.DISK
    assert by_worker["w2"].tier(None) is AdapterTier.NONE
    first_a, second_a, only_b = (r.reservation for r in routed)
    assert first_a is not None and second_a is not None and only_b is not None
    first_a.release()
    only_b.release()
    only_b.release()  # idempotent: gives nothing back twice
    assert state.candidates("tiny")[1].pending_adapters == {"a", "c"}  # a's second request still runs
    second_a.move("w1")  # queued again elsewhere: its adapter goes with it
    assert [c.pending_adapters for c in state.candidates("tiny")] == [{"a"}, {"c"}]
    second_a.release()
    assert [c.pending_adapters for c in state.candidates("tiny")] == [set(), {"c"}]


def test_a_burst_for_one_adapter_goes_where_the_first_went() -> None:
    """Adapter affinity within a burst, before any heartbeat reports the adapter: one load, not one per
    worker the tie-break happens to pick."""
    profiles = [{"name": "adapter-only", "plugins": [{"ref": "adapter"}, {"ref": "max"}]}]
    doc = {**DEFAULT_POLICY, "profiles": profiles, "default_profile": "adapter-only", "aliases": {}}
    profile = parse_policy(doc).profile("adapter-only")
    state = fleet(w1=0, w2=0, w3=0)
    chosen = {
        state.route(profile, request(adapter="x"), random.Random(seed), f"d{seed}").decision.worker_id
        for seed in range(12)
    }
    assert len(chosen) == 1
