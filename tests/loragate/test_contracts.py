"""The cross-process contracts (`loragate.contracts`): KV events round-trip and malformed ones are refused;
keys, patterns, fields and lifetimes agree with each other; and no other module spells one out."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest
import redis

from loragate import contracts
from loragate.contracts import ADAPTER_TIERS, AdapterTier, EventType, KVEvent


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
            KVEvent(EventType.ADAPTER_LOADED, adapter="tiny:a", tier=AdapterTier.DEVICE),
            '{"type":"adapter_loaded","adapter":"tiny:a","tier":"device"}',
            id="adapter loaded",
        ),
        pytest.param(
            KVEvent(EventType.ADAPTER_EVICTED, adapter="tiny:a", tier=AdapterTier.DISK),
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


# -- keys, fields and TTLs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "pattern"),
    [
        pytest.param(contracts.worker_state("w-1"), contracts.WORKER_STATE_PATTERN, id="heartbeat"),
        pytest.param(contracts.queue("w-1"), contracts.QUEUE_PATTERN, id="queue"),
        pytest.param(contracts.events("w-1"), contracts.EVENTS_PATTERN, id="events"),
    ],
)
def test_every_per_worker_key_matches_the_pattern_its_readers_scan_for(key: str, pattern: str) -> None:
    assert fnmatch.fnmatchcase(key, pattern)
    others = {contracts.WORKER_STATE_PATTERN, contracts.QUEUE_PATTERN, contracts.EVENTS_PATTERN} - {pattern}
    assert not any(fnmatch.fnmatchcase(key, p) for p in others)  # no reader picks up another's keys


def test_a_queue_key_names_its_worker() -> None:
    assert contracts.worker_id_of_queue(contracts.queue("gpu-7:a")) == "gpu-7:a"


@pytest.mark.parametrize("client_id", ["cmpl-1234abcd", "retry:42.x_y-z", "a" * 128])
def test_request_ids_are_scoped_by_tenant_and_give_back_the_clients_id(client_id: str) -> None:
    alice, bob = (
        contracts.scoped_request_id("alice", client_id),
        contracts.scoped_request_id("bob", client_id),
    )
    assert alice != bob  # the same id from two tenants names two requests
    assert contracts.client_request_id(alice) == contracts.client_request_id(bob) == client_id
    assert contracts.output(alice) != contracts.output(bob)
    assert contracts.request_record(alice) != contracts.request_record(bob)


def test_stream_fields_are_what_a_reader_gets_back_from_redis(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        for field, as_read in (
            (contracts.QUEUE_FIELD, contracts.QUEUE_FIELD_BYTES),
            (contracts.OUTPUT_FIELD, contracts.OUTPUT_FIELD_BYTES),
            (contracts.EVENTS_FIELD, contracts.EVENTS_FIELD_BYTES),
        ):
            r.xadd("contract-check", {field: "{}"})
            [(_, fields)] = r.xrevrange("contract-check", count=1)
            assert fields == {as_read: b"{}"}
        assert len({contracts.RECORD_FP, contracts.RECORD_QUEUE, contracts.RECORD_ENTRY}) == 3
    finally:
        r.delete("contract-check")
        r.close()


def test_lifetimes_are_consistent() -> None:
    # A heartbeat survives a missed beat; a record outlives the output a retry may replay.
    assert contracts.HEARTBEAT_TTL_S >= 2 * contracts.HEARTBEAT_S
    assert contracts.REQUEST_RECORD_GRACE_S > contracts.OUTPUT_TTL_S
    assert contracts.MODEL_MEMORY_S > contracts.HEARTBEAT_TTL_S


def test_adapter_tiers_in_events_are_the_resident_ones() -> None:
    assert {str(t) for t in ADAPTER_TIERS} == {"device", "host", "disk"}
    assert AdapterTier.NONE not in ADAPTER_TIERS  # "no adapter" is routing's notion, never an event
    with pytest.raises(ValueError):
        KVEvent(EventType.ADAPTER_LOADED, adapter="tiny:a", tier=AdapterTier.NONE)


# -- nobody else spells a contract ------------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("gateway", "policies", "worker", "kernels", "loadtest", "loragate")
_KEY_LITERAL = re.compile(r"^lg:")
_LUA_FIELD = re.compile(r"XADD',\s*[^,]+,\s*'\*',\s*'[a-z]+'")  # a Lua XADD with a literal field name


def _literals(path: Path) -> list[tuple[int, str | bytes]]:
    """String and bytes constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str | bytes)
        and id(node) not in docstrings
    ]


def _offences(path: Path) -> list[str]:
    found = []
    for line, value in _literals(path):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if _KEY_LITERAL.match(text) or _LUA_FIELD.search(text) or value in (b"m", b"e"):
            found.append(f"{path.relative_to(_ROOT)}:{line}: {text[:60]!r}")
    for node in ast.walk(ast.parse(path.read_text())):  # xadd(key, {"e": ...}): a field as a dict key
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "xadd":
            for arg in node.args[1:2]:
                if isinstance(arg, ast.Dict) and any(isinstance(k, ast.Constant) for k in arg.keys):
                    found.append(f"{path.relative_to(_ROOT)}:{node.lineno}: xadd with a literal field")
    return found


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The positive control: each kind of spelled-out contract is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""A docstring may say lg:q:{worker}."""\n'
        'KEY = "lg:q:w1"\n'
        'FIELD = fields[b"m"]\n'
        'r.xadd(key, {"e": 1})\n'
        "LUA = \"redis.call('XADD', KEYS[1], '*', 'm', ARGV[1])\"\n"
    )
    global _ROOT
    root, _ROOT = _ROOT, tmp_path
    try:
        assert len(_offences(bad)) == 4
    finally:
        _ROOT = root


def test_no_module_but_contracts_spells_a_key_or_a_stream_field() -> None:
    sources = [p for pkg in _PACKAGES for p in sorted((_ROOT / pkg).rglob("*.py"))]
    assert len(sources) > 100
    offences = [
        o for p in sources if p.name != "contracts.py" or p.parent.name != "loragate" for o in _offences(p)
    ]
    assert offences == []
