"""KV events: the JSON workers write to `lg:events:{worker}` round-trips; malformed events are refused."""

from __future__ import annotations

import pytest

from loragate.contracts import EventType, KVEvent


@pytest.mark.parametrize(
    ("event", "json_text"),
    [
        pytest.param(
            KVEvent(EventType.STORED, (1, 2**127)), f'{{"type":"stored","hashes":[1,{2**127}]}}', id="stored"
        ),
        pytest.param(
            KVEvent(EventType.EVICTED, (3,), ts=5.0), '{"type":"evicted","hashes":[3],"ts":5.0}', id="evicted"
        ),
        pytest.param(KVEvent(EventType.CLEARED), '{"type":"cleared"}', id="cleared"),
        pytest.param(
            KVEvent(EventType.ADAPTER_LOADED, adapter="tiny:a", tier="device"),
            '{"type":"adapter_loaded","adapter":"tiny:a","tier":"device"}',
            id="adapter loaded",
        ),
        pytest.param(
            KVEvent(EventType.ADAPTER_EVICTED, adapter="tiny:a", tier="disk"),
            '{"type":"adapter_evicted","adapter":"tiny:a","tier":"disk"}',
            id="adapter evicted",
        ),
    ],
)
def test_round_trip(event: KVEvent, json_text: str) -> None:
    assert event.to_json() == json_text
    assert KVEvent.from_json(json_text) == event


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param('{"type":"exploded"}', id="unknown type"),
        pytest.param('{"type":"stored","hashes":["ab"]}', id="hash not an integer"),
        pytest.param('{"type":"stored","hashes":5}', id="hashes not a list"),
        pytest.param('{"type":"adapter_loaded","adapter":"tiny:a","tier":"gpu"}', id="unknown tier"),
        pytest.param('{"type":"adapter_loaded","tier":"device"}', id="adapter missing"),
        pytest.param("[1, 2]", id="not an object"),
    ],
)
def test_malformed_events_are_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        KVEvent.from_json(raw)
