"""The queue-wait estimate (`gateway.queue_estimate`), without network: requests ahead (fleet backlog and
fair-queue turns), slots learned from heartbeats, the drain rate measured and from heartbeats."""

from __future__ import annotations

import math

import pytest

from gateway.fleet import WorkerView
from gateway.queue_estimate import DrainMeter, Load, WorkerSlots, fleet_rate
from loragate.messages import WorkerState


def view(
    worker_id: str, outstanding: int, running: int, waiting: int = 0, decode_tok_s: float = 0.0
) -> WorkerView:
    state = WorkerState(
        worker_id, "tiny", "/m", 2048, running=running, waiting=waiting, decode_tok_s=decode_tok_s
    )
    return WorkerView(state, outstanding)


AHEAD_CASES = [
    ("nothing queued", Load(0, {}, 1.0), "a", 0),
    ("the workers' backlog", Load(7, {}, 1.0), "a", 7),
    ("own queue", Load(2, {"a": 5}, 1.0), "a", 7),
    ("one turn of each other waiting tenant", Load(0, {"b": 9, "c": 9}, 1.0), "a", 2),
    ("others' turns up to own queue + 1", Load(0, {"a": 3, "b": 9, "c": 2}, 1.0), "a", 3 + 4 + 2),
]


@pytest.mark.parametrize(
    ("load", "tenant", "ahead"), [c[1:] for c in AHEAD_CASES], ids=[c[0] for c in AHEAD_CASES]
)
def test_requests_ahead(load: Load, tenant: str, ahead: int) -> None:
    assert load.ahead(tenant) == ahead
    n = ahead + 1
    assert load.wait_s(tenant) == ((n + 2 * math.sqrt(n)) / load.drain_rps if ahead else 0.0)


def test_backlog_counts_what_is_not_running() -> None:
    slots = WorkerSlots()
    # w1 is full (requests wait in it): 8 slots; w2 runs all it has; w3 has never been seen full.
    workers = [view("w1", 10, 8, waiting=2), view("w2", 3, 3), view("w3", 5, 0)]
    assert slots.backlog(workers) == 2 + 0 + 0
    assert slots.slots == {"w1": 8}


def test_slots_outlive_a_stale_heartbeat_and_grow_when_a_worker_runs_more() -> None:
    slots = WorkerSlots()
    assert slots.backlog([view("w1", 12, 4, waiting=8)]) == 8
    # A burst: the snapshot's outstanding is current, its heartbeat still says 0 running, nothing waiting.
    assert slots.backlog([view("w1", 30, 0)]) == 26
    # Later it runs 6 with none waiting (shorter sequences leave KV room): 6 slots, not 4.
    assert slots.backlog([view("w1", 6, 6)]) == 0
    assert slots.backlog([view("w1", 10, 6)]) == 4
    # Full again at 5 (longer sequences): 5.
    assert slots.backlog([view("w1", 10, 5, waiting=3)]) == 5


def reporting(
    worker_id: str, outstanding: int, running: int, waiting: int, kv_free: int, max_running: int = 32
) -> WorkerView:
    """A worker that reports its capacity: a batch of `max_running`, 1,000 KV blocks of 16 tokens, requests
    of up to 2,048 tokens (128 blocks)."""
    state = WorkerState(
        worker_id, "tiny", "/m", 2048, running=running, waiting=waiting, max_running=max_running,
        kv_blocks_total=1000, kv_blocks_free=kv_free, block_size=16,
    )  # fmt: skip
    return WorkerView(state, outstanding)


def test_requests_waiting_for_their_prefill_turn_do_not_make_a_worker_full() -> None:
    """A burst of 32 on a worker that runs 32: its heartbeat says 4 running, 28 waiting (a few prompts a
    step fit the prefill budget), with room in its batch and its KV pool: no slots learned, no backlog."""
    slots = WorkerSlots()
    assert slots.backlog([reporting("w1", 32, 4, 28, kv_free=900)]) == 0
    assert slots.slots == {}
    # Its batch full: it runs 32, the rest waits for room.
    assert slots.backlog([reporting("w1", 40, 32, 8, kv_free=600)]) == 8
    assert slots.slots == {"w1": 32}
    # Its KV pool short of one more longest request (128 blocks): what it runs is its room now.
    slots = WorkerSlots()
    assert slots.backlog([reporting("w2", 30, 20, 10, kv_free=127)]) == 10
    assert slots.backlog([reporting("w2", 30, 20, 10, kv_free=128)]) == 10  # learned: kept, not lowered
    assert slots.backlog([reporting("w2", 30, 24, 6, kv_free=128)]) == 6  # runs more: more slots


def test_fleet_rate_from_heartbeats() -> None:
    workers = [view("w1", 0, 0, decode_tok_s=100.0), view("w2", 0, 0, decode_tok_s=50.0)]
    assert fleet_rate(workers, 30.0) == 5.0
    assert fleet_rate(workers, None) == 0.0


# -- the drain meter -------------------------------------------------------------------------------------
def test_a_young_meter_divides_by_its_age() -> None:
    meter = DrainMeter(now=0.0, window_s=10.0)
    assert meter.rate(0.5) == 0.0 and meter.tokens_per_request(0.5) is None
    for t, tokens in ((1.0, 10), (1.0, 20), (1.0, 30), (2.0, 40)):
        meter.finished(t, tokens)
    assert meter.rate(2.0) == 2.0
    assert meter.tokens_per_request(2.0) == 25.0


def test_a_full_window_and_an_idle_spell() -> None:
    meter = DrainMeter(now=0.0, window_s=10.0)
    for second in range(1, 31):  # 3 per second for 30 s
        for _ in range(3):
            meter.finished(float(second), 8)
    assert meter.rate(30.0) == pytest.approx(3.3)  # 33 in [20, 30]
    # Idle for a minute: the window is empty, the last measured capacity is kept (not 0 = unknown).
    assert meter.rate(90.0) == pytest.approx(3.3)
    assert meter.tokens_per_request(90.0) == 8.0


def test_tokens_per_request_falls_back_to_what_was_asked() -> None:
    meter = DrainMeter(now=0.0)
    meter.asked(100)
    assert meter.tokens_per_request(1.0) == 100.0
