"""The policy document: the default parses, and every kind of mistake names its exact path."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from policies.default_policy import DEFAULT_POLICY
from policies.difficulty import HeuristicEstimator
from policies.document import dump_policy, load_policy_file, parse_policy
from policies.framework import PolicyError
from policies.pickers.maximum import MaxPicker
from policies.pickers.round_robin import RoundRobinPicker

Edit = Callable[[dict[str, Any]], object]


def test_the_default_policy() -> None:
    policy = parse_policy(DEFAULT_POLICY)
    assert set(policy.profiles) == {"default", "least-loaded", "round-robin", "random"}
    default = policy.profile()
    assert [f.name for f in default.filters] == [
        "serves-model", "not-draining", "healthy", "tenant-allowed", "queue-bound", "kv-room",
    ]  # fmt: skip
    assert {s.name: w for s, w in default.scorers} == {
        "prefix": 3,
        "adapter": 2,
        "load": 2,
        "cost": 6,
        "difficulty": 1,
    }
    assert isinstance(default.picker, MaxPicker)
    assert isinstance(policy.profile("round-robin").picker, RoundRobinPicker)
    assert policy.aliases["auto"].models == ("tiny", "smollm2")
    assert isinstance(policy.estimator, HeuristicEstimator)


def test_parsing_neither_mutates_nor_shares_the_document() -> None:
    before = copy.deepcopy(DEFAULT_POLICY)
    policy = parse_policy(DEFAULT_POLICY)
    assert before == DEFAULT_POLICY and policy.document == before
    assert policy.document["plugins"] is not DEFAULT_POLICY["plugins"]


def test_minimal_document_defaults() -> None:
    policy = parse_policy(
        {"plugins": [{"type": "random"}], "profiles": [{"name": "p", "plugins": [{"ref": "random"}]}]}
    )
    assert policy.default_profile == "p" and policy.aliases == {} and policy.profile("p").filters == ()


def test_unknown_profile_is_a_policy_error() -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(DEFAULT_POLICY).profile("fastest")
    assert e.value.path == "profile"


def plugin_param(i: int, key: str, value: object) -> Edit:
    return lambda d: d["plugins"][i].setdefault("parameters", {}).__setitem__(key, value)


def profile_ref(i: int, j: int, **entry: object) -> Edit:
    return lambda d: d["profiles"][i]["plugins"].__setitem__(j, entry)


def rung(k: int, **entry: object) -> Edit:
    return lambda d: d["aliases"]["auto"]["rungs"].__setitem__(k, entry)


# the default document's plugins: 0 serves-model … 4 queue-bound, 5 kv-room, 6 prefix, 11 max, 12 round-robin
CASES: list[tuple[str, Edit, str]] = [
    ("plugins not a list", lambda d: d.update(plugins={"type": "random"}), "plugins"),
    ("unknown top-level key", lambda d: d.update(profile="x"), "profile"),
    ("plugins missing", lambda d: d.pop("plugins"), "plugins"),
    ("description not text", lambda d: d.update(description=3), "description"),
    ("plugin not an object", lambda d: d["plugins"].__setitem__(2, "healthy"), "plugins[2]"),
    ("unknown plugin type", lambda d: d["plugins"][1].update(type="teleport"), "plugins[1].type"),
    ("unknown plugin key", lambda d: d["plugins"][1].update(params={}), "plugins[1].params"),
    ("duplicate plugin name", lambda d: d["plugins"][1].update(name="serves-model"), "plugins[1].name"),
    ("bad parameter value", plugin_param(4, "max_outstanding", -1), "plugins[4].parameters.max_outstanding"),
    (
        "parameter not a number",
        plugin_param(5, "headroom_tokens", "lots"),
        "plugins[5].parameters.headroom_tokens",
    ),
    ("unknown parameter", plugin_param(6, "boost", 2), "plugins[6].parameters.boost"),
    ("parameters not an object", lambda d: d["plugins"][4].update(parameters=[1]), "plugins[4].parameters"),
    ("no profiles", lambda d: d.update(profiles=[]), "profiles"),
    ("duplicate profile name", lambda d: d["profiles"][1].update(name="default"), "profiles[1].name"),
    ("profile without plugins", lambda d: d["profiles"][0].pop("plugins"), "profiles[0].plugins"),
    ("unknown reference", profile_ref(0, 1, ref="nope"), "profiles[0].plugins[1].ref"),
    ("reference twice", profile_ref(0, 1, ref="serves-model"), "profiles[0].plugins[1].ref"),
    ("weight on a filter", profile_ref(0, 1, ref="not-draining", weight=2), "profiles[0].plugins[1].weight"),
    ("zero weight", profile_ref(0, 6, ref="prefix", weight=0), "profiles[0].plugins[6].weight"),
    ("negative weight", profile_ref(0, 6, ref="prefix", weight=-1), "profiles[0].plugins[6].weight"),
    ("two pickers", lambda d: d["profiles"][0]["plugins"].append({"ref": "random"}), "profiles[0].plugins"),
    ("no picker", lambda d: d["profiles"][2]["plugins"].pop(), "profiles[2].plugins"),
    ("unknown default profile", lambda d: d.update(default_profile="fast"), "default_profile"),
    ("alias without rungs", lambda d: d["aliases"]["auto"].pop("rungs"), "aliases.auto.rungs"),
    ("alias with empty rungs", lambda d: d["aliases"]["auto"].update(rungs=[]), "aliases.auto.rungs"),
    ("rung model missing", rung(1), "aliases.auto.rungs[1].model"),
    ("rung model empty", rung(1, model=""), "aliases.auto.rungs[1].model"),
    ("max_score missing", rung(0, model="tiny"), "aliases.auto.rungs[0].max_score"),
    ("max_score on the last rung", rung(1, model="small", max_score=1), "aliases.auto.rungs[1].max_score"),
    ("max_score above 1", rung(0, model="tiny", max_score=1.5), "aliases.auto.rungs[0].max_score"),
    (
        "bands not ascending",
        lambda d: d["aliases"]["auto"]["rungs"].insert(1, {"model": "mid", "max_score": 0.3}),
        "aliases.auto.rungs[1].max_score",
    ),
    ("unknown rung key", rung(0, model="tiny", max_score=0.4, weight=1), "aliases.auto.rungs[0].weight"),
    ("alias profile unknown", lambda d: d["aliases"]["auto"].update(profile="x"), "aliases.auto.profile"),
    (
        "negative threshold",
        lambda d: d["aliases"]["auto"].update(saturation_threshold=-0.1),
        "aliases.auto.saturation_threshold",
    ),
    ("margin above 1", lambda d: d["aliases"]["auto"].update(shift_margin=2), "aliases.auto.shift_margin"),
    ("aliases not an object", lambda d: d.update(aliases=[]), "aliases"),
    ("unknown estimator", lambda d: d.update(difficulty={"estimator": "oracle"}), "difficulty.estimator"),
]


@pytest.mark.parametrize(("edit", "path"), [pytest.param(e, p, id=name) for name, e, p in CASES])
def test_errors_name_the_field(edit: Edit, path: str) -> None:
    doc = copy.deepcopy(DEFAULT_POLICY)
    edit(doc)
    with pytest.raises(PolicyError) as e:
        parse_policy(doc)
    assert e.value.path == path, e.value
    assert str(e.value).startswith(f"{path}: ")


def test_an_alias_stored_with_the_old_field_name_tiers_still_loads() -> None:
    doc = copy.deepcopy(DEFAULT_POLICY)
    doc["aliases"]["auto"]["tiers"] = doc["aliases"]["auto"].pop("rungs")
    assert parse_policy(doc).aliases == parse_policy(DEFAULT_POLICY).aliases


def test_an_alias_with_both_rungs_and_tiers_is_an_error() -> None:
    doc = copy.deepcopy(DEFAULT_POLICY)
    doc["aliases"]["auto"]["tiers"] = [{"model": "tiny"}]
    with pytest.raises(PolicyError) as e:
        parse_policy(doc)
    assert e.value.path == "aliases.auto.tiers"


def test_a_document_that_is_not_an_object() -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(["plugins"])
    assert e.value.path == "$"


@pytest.mark.parametrize("as_json", [pytest.param(False, id="yaml"), pytest.param(True, id="json")])
def test_load_policy_file(tmp_path: Path, as_json: bool) -> None:
    path = tmp_path / ("p.json" if as_json else "p.yaml")
    path.write_text(dump_policy(DEFAULT_POLICY, as_json=as_json))
    assert load_policy_file(path).document == DEFAULT_POLICY


@pytest.mark.parametrize(
    "text", [pytest.param("plugins: [", id="broken YAML"), pytest.param(None, id="missing file")]
)
def test_unreadable_files(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "p.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy_file(path)
    assert e.value.path == "$"


def test_dump_is_plain_yaml() -> None:
    text = dump_policy(DEFAULT_POLICY)
    assert "&id" not in text and json.loads(json.dumps(DEFAULT_POLICY)) == DEFAULT_POLICY
