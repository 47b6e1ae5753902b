"""`round-robin`: call k picks k mod n, ignoring totals and the random source."""

from __future__ import annotations

import random

from policies.pickers.round_robin import RoundRobinPicker


def test_cycles_through_the_candidates() -> None:
    picker, rng = RoundRobinPicker("rr"), random.Random(0)
    assert [picker.pick([0.0, 1.0, 0.5], rng) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_each_instance_has_its_own_counter() -> None:
    first, second = RoundRobinPicker("a"), RoundRobinPicker("b")
    first.pick([0.0, 0.0], random.Random(0))
    assert second.pick([0.0, 0.0], random.Random(0)) == 0
