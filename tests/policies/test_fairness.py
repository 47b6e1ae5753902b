"""The VTC fair queue: smallest counter first, no banked idleness, weights, and a flood cannot starve."""

from __future__ import annotations

import pytest

from policies.fairness import FairQueue, token_cost


def drain(queue: FairQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_a_flood_does_not_starve_a_light_tenant() -> None:
    """One item served per tick; the flood queues 300 at once, the light tenant one every 10 ticks."""
    queue: FairQueue[tuple[str, int]] = FairQueue()
    for i in range(300):
        queue.push("flood", ("flood", i), cost_estimate=200)
    waits = []
    for tick in range(200):
        if tick % 10 == 0:
            queue.push("light", ("light", tick), cost_estimate=200)
        tenant, arrived = queue.pop()
        if tenant == "light":
            waits.append(tick - arrived)
    assert len(waits) == 20 and max(waits) <= 1  # FIFO would have made the first wait 300 ticks


@pytest.mark.parametrize(
    ("pushes", "order"),
    [
        pytest.param(
            [("a", "a1", 5), ("b", "b1", 1), ("b", "b2", 1)], ["a1", "b1", "b2"], id="ties: oldest first"
        ),
        pytest.param(
            [("a", "a1", 10), ("a", "a2", 10), ("b", "b1", 1), ("b", "b2", 1)],
            ["a1", "b1", "b2", "a2"],
            id="smallest counter next",
        ),
    ],
)
def test_order(pushes: list[tuple[str, str, float]], order: list[str]) -> None:
    queue: FairQueue[str] = FairQueue()
    for tenant, item, cost in pushes:
        queue.push(tenant, item, cost)
    assert drain(queue) == order


def test_idle_time_is_not_banked_while_others_wait() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(10):
        queue.push("busy", f"busy{i}", 100)
    for _ in range(5):
        queue.pop()  # busy's counter: 500, while "late" was away
    for i in range(3):
        queue.push("late", f"late{i}", 100)
    assert queue.counter("late") == queue.counter("busy") == 500
    assert drain(queue)[:4] == ["busy5", "late0", "busy6", "late1"]  # alternating, not three late in a row


def test_a_tenant_arriving_at_an_empty_queue_starts_at_the_last_one_to_leave() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a1", 300)
    queue.pop()
    queue.push("b", "b1", 1)
    assert queue.counter("b") == 300


def test_a_returning_tenant_keeps_a_higher_counter() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.charge("heavy", 900)
    queue.push("light", "l1", 1)
    queue.push("heavy", "h1", 1)
    assert queue.counter("heavy") == 900 and drain(queue) == ["l1", "h1"]


def test_weights_share_tokens_in_proportion() -> None:
    queue: FairQueue[str] = FairQueue(weights={"gold": 2.0})
    for _ in range(30):
        queue.push("gold", "gold", 10)
        queue.push("free", "free", 10)
    served = [queue.pop() for _ in range(30)]
    assert served.count("gold") == 20


def test_charge_corrects_the_estimate() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a1", 100)
    queue.pop()
    queue.charge("a", token_cost(10, 20) - 100)  # served 10 prompt + 20 generated tokens
    assert queue.counter("a") == 50


@pytest.mark.parametrize(
    ("tenant", "item", "removed", "left"),
    [
        pytest.param("a", "a1", True, ["a2"], id="waiting item removed"),
        pytest.param("a", "zz", False, ["a1", "a2"], id="unknown item"),
        pytest.param("b", "a1", False, ["a1", "a2"], id="unknown tenant"),
    ],
)
def test_remove(tenant: str, item: str, removed: bool, left: list[str]) -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a1", 1)
    queue.push("a", "a2", 1)
    assert queue.remove(tenant, item) is removed
    assert drain(queue) == left


def test_removing_the_last_item_leaves_the_queue() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a1", 1)
    assert queue.remove("a", "a1") and len(queue) == 0 and queue.waiting_tenants == ()


def test_empty_queue_raises_and_weights_must_be_positive() -> None:
    with pytest.raises(IndexError):
        FairQueue[str]().pop()
    with pytest.raises(ValueError):
        FairQueue[str](weights={"a": 0})
