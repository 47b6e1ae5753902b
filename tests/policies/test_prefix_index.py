"""The prefix index: precise from KV events, approximate from routing, longest leading run, bounded LRU."""

from __future__ import annotations

import pytest

from loragate.contracts import EventType, KVEvent
from policies.prefix_index import PrefixIndex


def stored(*hashes: int) -> KVEvent:
    return KVEvent(EventType.STORED, hashes)


@pytest.mark.parametrize(
    ("events", "query", "expected"),
    [
        pytest.param([], (1, 2), 0, id="unknown worker"),
        pytest.param([stored(1, 2, 3)], (1, 2, 3, 4), 3, id="leading run"),
        pytest.param([stored(2, 3)], (1, 2, 3), 0, id="first block missing: nothing usable"),
        pytest.param(
            [stored(1, 2, 3), KVEvent(EventType.EVICTED, (2,))], (1, 2, 3), 1, id="eviction cuts run"
        ),
        pytest.param([stored(1, 2), KVEvent(EventType.CLEARED)], (1, 2), 0, id="cleared"),
        pytest.param([KVEvent(EventType.EVICTED, (1,))], (1,), 0, id="eviction on an unknown worker"),
    ],
)
def test_block_events(events: list[KVEvent], query: tuple[int, ...], expected: int) -> None:
    index = PrefixIndex()
    for event in events:
        index.apply_event("w1", event)
    assert index.cached_blocks("w1", query) == expected


def test_approximate_mode_records_what_was_routed_per_worker() -> None:
    index = PrefixIndex()
    index.record_routed("w1", [1, 2, 3])
    index.record_routed("w2", [1, 9])
    assert index.cached_by_worker(["w1", "w2", "w3"], [1, 2, 3]) == {"w1": 3, "w2": 1, "w3": 0}


def test_lru_bound_drops_the_least_recently_stored() -> None:
    index = PrefixIndex(capacity=3)
    index.record_routed("w1", [1, 2, 3])
    index.record_routed("w1", [1])  # touch 1: 2 is now the oldest
    index.apply_event("w1", stored(4))
    assert index.size("w1") == 3
    assert index.cached_blocks("w1", [1]) == 1 and index.cached_blocks("w1", [2]) == 0


def test_capacity_is_per_worker_and_forget_worker_frees_it() -> None:
    index = PrefixIndex(capacity=2)
    index.record_routed("w1", [1, 2])
    index.record_routed("w2", [1, 2])
    index.forget_worker("w1")
    assert index.workers == ("w2",) and index.cached_blocks("w1", [1]) == 0 and index.size("w2") == 2


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param([], None, id="no adapter events"),
        pytest.param([("adapter_loaded", "a", "host")], ((), ("a",)), id="loaded to host"),
        pytest.param(
            [("adapter_loaded", "a", "host"), ("adapter_loaded", "a", "device")], (("a",), ()), id="promoted"
        ),
        pytest.param(
            [("adapter_loaded", "a", "device"), ("adapter_evicted", "a", "host")], ((), ("a",)), id="demoted"
        ),
        pytest.param(
            [("adapter_loaded", "a", "device"), ("adapter_evicted", "a", "disk")], ((), ()), id="gone"
        ),
    ],
)
def test_adapter_residency(
    events: list[tuple[str, str, str]], expected: tuple[tuple[str, ...], tuple[str, ...]] | None
) -> None:
    index = PrefixIndex()
    for kind, adapter, tier in events:
        index.apply_event("w1", KVEvent(EventType(kind), adapter=adapter, tier=tier))
    assert index.resident_adapters("w1") == expected


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)
