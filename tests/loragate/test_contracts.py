"""The cross-process contracts (`loragate.contracts`): KV events round-trip and malformed ones are refused;
keys, patterns, fields and lifetimes agree with each other; and no other module spells one out."""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.cluster import key_slot

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
        pytest.param(contracts.worker_state("m", "w-1"), contracts.WORKER_STATE_PATTERN, id="heartbeat"),
        pytest.param(contracts.queue("m", "w-1"), contracts.QUEUE_PATTERN, id="queue"),
        pytest.param(contracts.events("m", "w-1"), contracts.EVENTS_PATTERN, id="events"),
    ],
)
def test_every_per_worker_key_matches_the_pattern_its_readers_scan_for(key: str, pattern: str) -> None:
    assert fnmatch.fnmatchcase(key, pattern)
    others = {contracts.WORKER_STATE_PATTERN, contracts.QUEUE_PATTERN, contracts.EVENTS_PATTERN} - {pattern}
    assert not any(fnmatch.fnmatchcase(key, p) for p in others)  # no reader picks up another's keys


@pytest.mark.parametrize("key_of", [contracts.queue, contracts.worker_state, contracts.events])
@pytest.mark.parametrize(("model", "worker"), [("tiny", "gpu-7:a"), ("org/base-7b:v1", "w:{x}:1")])
def test_a_worker_key_names_its_model_and_worker(
    key_of: Callable[[str, str], str], model: str, worker: str
) -> None:
    assert contracts.of_worker_key(key_of(model, worker)) == (model, worker)


def test_a_models_request_path_keys_share_one_hash_tag_and_models_differ() -> None:
    """Redis Cluster runs a script or transaction only over keys of one slot: every key a request's path
    touches together carries its base model's tag (and a client id cannot break out of it)."""
    rid = contracts.scoped_request_id("alice", "x}{y")

    def keys(model: str) -> list[str]:
        return [
            contracts.queue(model, "w1"),
            contracts.queue(model, "w2"),
            contracts.model_queue(model),
            contracts.output(model, rid),
            contracts.request_record(model, rid),
            contracts.worker_state(model, "w1"),
            contracts.events(model, "w1"),
        ]

    assert {contracts.tag_of(k) for k in keys("tiny")} == {"tiny"}
    assert {contracts.tag_of(k) for k in keys("org/base:v1")} == {"org/base:v1"}
    assert contracts.tag_of(contracts.queue("tiny", "w1")) != contracts.tag_of(contracts.queue("small", "w1"))
    assert {
        contracts.tag_of(k) for k in (contracts.POLICY, contracts.POLICY_ACTIVE, contracts.POLICY_SEQ)
    } == {"policy"}
    assert {key_slot(k.encode()) for k in keys("tiny")} == {key_slot(b"{tiny}")}


@pytest.mark.parametrize("name", ["", "a{b", "a}b", "{tiny}"])
def test_a_model_name_that_would_break_its_hash_tag_is_refused(name: str) -> None:
    with pytest.raises(ValueError):
        contracts.check_model_name(name)


def test_ordinary_model_names_are_accepted() -> None:
    for name in ("tiny", "org/model:v1", "org/base-7b:v1", "Qwen2.5-0.5B"):
        assert contracts.check_model_name(name) == name


def test_a_models_queue_patterns_match_its_queues_only(redis_url: str) -> None:
    """The glob characters of a model's name are matched literally (a real `SCAN MATCH`)."""
    r = redis.Redis.from_url(redis_url)
    try:
        for model in ("a*b", "axxb", "a?b[1]"):
            r.xadd(contracts.queue(model, "w1"), {"m": "x"})
            r.xadd(contracts.model_queue(model), {"m": "x"})
        workers, shared = contracts.queue_patterns("a*b")
        assert [k.decode() for k in r.scan_iter(match=workers)] == [contracts.queue("a*b", "w1")]
        assert [k.decode() for k in r.scan_iter(match=shared)] == [contracts.model_queue("a*b")]
        workers, shared = contracts.queue_patterns("a?b[1]")
        assert [k.decode() for k in r.scan_iter(match=workers)] == [contracts.queue("a?b[1]", "w1")]
        everything = {k.decode() for p in contracts.queue_patterns() for k in r.scan_iter(match=p)}
        assert len(everything) == 6
    finally:
        r.close()


@pytest.mark.parametrize("client_id", ["cmpl-1234abcd", "retry:42.x_y-z", "a" * 128])
def test_request_ids_are_scoped_by_tenant_and_give_back_the_clients_id(client_id: str) -> None:
    alice, bob = (
        contracts.scoped_request_id("alice", client_id),
        contracts.scoped_request_id("bob", client_id),
    )
    assert alice != bob  # the same id from two tenants names two requests
    assert contracts.client_request_id(alice) == contracts.client_request_id(bob) == client_id
    assert contracts.output("m", alice) != contracts.output("m", bob)
    assert contracts.request_record("m", alice) != contracts.request_record("m", bob)


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
