"""The per-adapter label cap keeps metric cardinality bounded whatever the number of adapters."""

from __future__ import annotations

from gateway.metrics import AdapterLabeler


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
