"""Routing until the policies issue: least-loaded, prefix affinity within a slack, adapter tier, 429/503."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from gateway.catalog import Target
from gateway.errors import APIError
from gateway.fleet import Fleet, WorkerView
from gateway.prefix_index import ApproxPrefixIndex
from gateway.router import pick_worker
from loragate.messages import AdapterRecord, WorkerState

ADAPTER = AdapterRecord("a", "tiny", "/x")


def fleet(*workers: tuple[str, int, int, tuple[str, ...], tuple[str, ...]]) -> Fleet:
    """(id, running, outstanding, adapters on device, adapters in host memory) per worker, serving tiny."""
    f = Fleet(aioredis.Redis())  # never contacted: routing reads the snapshot only
    f.workers = {
        wid: WorkerView(
            WorkerState(wid, "tiny", "/m", 2048, adapters_device=dev, adapters_host=host, running=running),
            queued,
        )
        for wid, running, queued, dev, host in workers
    }
    return f


@pytest.mark.parametrize(
    ("name", "workers", "adapter", "cached", "expected"),
    [
        ("least outstanding wins", [("w1", 5, 5, (), ()), ("w2", 1, 1, (), ())], None, {}, "w2"),
        (
            "ties go to the adapter on device",
            [("w1", 1, 0, (), ()), ("w2", 1, 0, ("tiny:a",), ())],
            ADAPTER,
            {},
            "w2",
        ),
        ("host memory beats disk", [("w1", 1, 0, (), ()), ("w2", 1, 0, (), ("tiny:a",))], ADAPTER, {}, "w2"),
        ("ties otherwise by id", [("w2", 0, 0, (), ()), ("w1", 0, 0, (), ())], None, {}, "w1"),
        (
            "prefix affinity within the slack",
            [("w1", 0, 0, (), ()), ("w2", 5, 0, (), ())],
            None,
            {"w2": 3},
            "w2",
        ),
        (
            "longest cached prefix",
            [("w1", 0, 0, (), ()), ("w2", 0, 0, (), ())],
            None,
            {"w1": 2, "w2": 5},
            "w2",
        ),
        ("too busy for affinity", [("w1", 0, 0, (), ()), ("w2", 9, 20, (), ())], None, {"w2": 9}, "w1"),
    ],
)
def test_pick_worker(
    name: str, workers: list, adapter: AdapterRecord | None, cached: dict[str, int], expected: str
) -> None:
    chosen = pick_worker(fleet(*workers), Target("tiny", adapter), max_queue=10, cached_blocks=cached)
    assert chosen.state.worker_id == expected, name


def test_full_queues_give_429_with_retry_after() -> None:
    with pytest.raises(APIError) as e:
        pick_worker(fleet(("w1", 0, 10, (), ()), ("w2", 0, 12, (), ())), Target("tiny", None), max_queue=10)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"


def test_no_worker_for_the_model_gives_503() -> None:
    with pytest.raises(APIError) as e:
        pick_worker(fleet(("w1", 0, 0, (), ())), Target("small", None), max_queue=10)
    assert e.value.status == 503


def test_draining_workers_are_not_candidates() -> None:
    f = fleet(("w1", 0, 0, (), ()), ("w2", 9, 9, (), ()))
    view = f.workers["w1"]
    f.workers["w1"] = WorkerView(dataclasses.replace(view.state, draining=True), view.queue_len)
    assert pick_worker(f, Target("tiny", None), max_queue=10).state.worker_id == "w2"


def test_prefix_index_tracks_the_latest_owner_and_is_bounded() -> None:
    index = ApproxPrefixIndex(capacity=4)
    index.record("w1", [1, 2, 3])
    assert index.cached_blocks([1, 2, 3, 4]) == {"w1": 3}
    index.record("w2", [1, 2])
    assert index.cached_blocks([1, 2, 3]) == {"w2": 2}
    index.record("w3", [7, 8, 9])
    assert index.cached_blocks([1, 2]) == {}  # evicted (LRU, capacity 4)
