"""The per-adapter label cap keeps metric cardinality bounded whatever the number of adapters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from gateway.fleet import Fleet
from gateway.metrics import AdapterLabeler, GatewayMetrics
from loragate.messages import WorkerState


def test_first_busy_adapters_keep_labels_and_the_rest_are_other() -> None:
    labeler = AdapterLabeler(top_adapters=3)
    labels = {labeler.label(f"tiny:a{i}") for i in range(200) for _ in range(2)}
    assert labels == {"tiny:a0", "tiny:a1", "tiny:a2", "other"}
    assert labeler.label(None) == "none"
    assert labeler.label("tiny:a1") == "tiny:a1"


def test_min_requests_delays_labelling_and_the_tally_stays_bounded() -> None:
    labeler = AdapterLabeler(top_adapters=2, min_requests=3)
    assert [labeler.label("x") for _ in range(3)] == ["other", "other", "x"]
    for i in range(1000):
        labeler.label(f"rare{i}")
    assert len(labeler.counts) <= 10 * 2 + 1


def _metrics(*views: SimpleNamespace) -> GatewayMetrics:
    """Metrics over a stand-in fleet: the collector reads only `workers` (each view's state and queue_len)."""
    fleet = SimpleNamespace(workers={v.state.worker_id: v for v in views})
    return GatewayMetrics(cast(Fleet, fleet), top_adapters=1)


def test_finished_requests_feed_every_series() -> None:
    metrics = _metrics()
    metrics.finished("tiny:a", "tiny", "tiny:a", 0.2, 1.5, 0.01, prompt=100, cached=64, completion=10)
    metrics.finished("tiny:b", "tiny", "tiny:b", 0.3, 2.0, None, prompt=10, cached=20, completion=5)
    sample = metrics.registry.get_sample_value
    assert sample("loragate_requests_total", {"model": "tiny", "adapter": "tiny:a", "status": "200"}) == 1
    assert sample("loragate_requests_total", {"model": "tiny", "adapter": "other", "status": "200"}) == 1
    assert sample("loragate_ttft_seconds_count", {"model": "tiny"}) == 2
    assert sample("loragate_ttft_seconds_sum", {"model": "tiny"}) == pytest.approx(0.5)
    assert sample("loragate_request_duration_seconds_sum", {"model": "tiny"}) == pytest.approx(3.5)
    assert sample("loragate_itl_seconds_count", {"model": "tiny"}) == 1  # no ITL for the second
    assert sample("loragate_prompt_tokens_total", {"kind": "cached"}) == 84
    assert sample("loragate_prompt_tokens_total", {"kind": "computed"}) == 36  # never negative
    assert sample("loragate_completion_tokens_total", {"model": "tiny"}) == 15


@pytest.mark.parametrize(
    ("status", "rejected"),
    [
        pytest.param(429, True, id="429 is a refusal"),
        pytest.param(503, True, id="503 is a refusal"),
        pytest.param(504, True, id="504 is a refusal"),
        pytest.param(400, False, id="400 is not"),
        pytest.param(500, False, id="500 is not"),
    ],
)
def test_failed_requests(status: int, rejected: bool) -> None:
    metrics = _metrics()
    metrics.failed("tiny", None, status)
    sample = metrics.registry.get_sample_value
    assert sample("loragate_requests_total", {"model": "tiny", "adapter": "none", "status": str(status)}) == 1
    assert sample("loragate_rejected_total", {"status": str(status)}) == (1 if rejected else None)


def test_worker_gauges_are_read_from_the_fleet_at_scrape_time() -> None:
    state = WorkerState("w1", "tiny", "/m", 512, kv_blocks_free=30, kv_blocks_total=100, running=3, waiting=2)
    metrics = _metrics(SimpleNamespace(state=state, queue_len=7))
    sample = metrics.registry.get_sample_value
    assert sample("loragate_worker_queue_depth", {"worker": "w1", "model": "tiny"}) == 7
    assert sample("loragate_worker_kv_blocks", {"worker": "w1", "state": "free"}) == 30
    assert sample("loragate_worker_kv_blocks", {"worker": "w1", "state": "used"}) == 70
    assert sample("loragate_worker_running", {"worker": "w1"}) == 3
    assert sample("loragate_worker_waiting", {"worker": "w1"}) == 2
