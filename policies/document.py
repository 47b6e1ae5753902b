"""The policy document → a `Policy`: plugins, profiles, routing aliases and the difficulty estimator.

The document (YAML or JSON; `policies.default_policy.DEFAULT_POLICY` is the reference):

    description: free text (optional)
    default_profile: the profile used when a request names none (default: the first profile)
    plugins:    [{type: <plugin type>, name: <unique, default the type>, parameters: {...}}, ...]
    profiles:   [{name: <unique>, plugins: [{ref: <plugin name>, weight: <scorers only, > 0, default 1>}]}]
    aliases:    {<alias>: {rungs: [{max_score: 0.4, model: tiny}, {model: small}],
                           saturation_threshold: 0.85, shift_margin: 1, profile: <profile>}}
    difficulty: {estimator: heuristic | learned, parameters: {...} | path: FILE | model: {...}}

A profile lists its plugins by reference; filters run in the listed order, scorers are weighted and a
profile holds exactly one picker. `parse_policy` checks everything and raises `PolicyError` whose `path`
names the offending field (`plugins[3].parameters.max_outstanding`, `profiles[0].plugins[1].ref`,
`aliases.auto.rungs[1].model`), so the admin API can answer 400 with it. Unknown keys are errors, so a
typo never silently falls back to a default. Plugin types come from `policies.plugin_types.PLUGIN_TYPES`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from policies import validate
from policies.alias_ladder import Alias, Rung
from policies.difficulty import Estimator
from policies.estimators import build_estimator
from policies.framework import Filter, Picker, Plugin, PolicyError, Profile, Scorer
from policies.plugin_types import PLUGIN_TYPES

TOP_KEYS = ("description", "default_profile", "plugins", "profiles", "aliases", "difficulty")


@dataclass(frozen=True)
class Policy:
    profiles: Mapping[str, Profile]
    default_profile: str
    aliases: Mapping[str, Alias]
    estimator: Estimator
    document: Mapping[str, Any]  # a private copy of the document it was parsed from

    def profile(self, name: str | None = None) -> Profile:
        """The named profile, or the default one; PolicyError (path `profile`) for an unknown name."""
        chosen = self.default_profile if name is None else name
        if chosen not in self.profiles:
            raise PolicyError("profile", f"unknown profile {chosen!r} (known: {', '.join(self.profiles)})")
        return self.profiles[chosen]


def parse_policy(doc: Any, base_dir: Path | None = None) -> Policy:
    """Validates `doc` and builds its plugins and profiles; `base_dir` resolves a relative model path."""
    top = validate.mapping(doc, "")
    validate.known_keys(top, "", TOP_KEYS, required=("plugins", "profiles"))
    if "description" in top and not isinstance(top["description"], str):
        raise PolicyError("description", "must be a string")
    plugins = _plugins(top["plugins"])
    profiles = _profiles(top["profiles"], plugins)
    default = validate.string(top.get("default_profile", next(iter(profiles))), "default_profile")
    if default not in profiles:
        raise PolicyError("default_profile", f"unknown profile {default!r} (known: {', '.join(profiles)})")
    aliases_raw = validate.mapping(top.get("aliases", {}), "aliases")
    aliases = {name: _alias(name, raw, profiles) for name, raw in aliases_raw.items()}
    estimator = build_estimator(top.get("difficulty", {}), "difficulty", base_dir)
    return Policy(
        MappingProxyType(profiles), default, MappingProxyType(aliases), estimator, copy.deepcopy(dict(top))
    )


def load_policy_file(path: str | Path) -> Policy:
    """A policy from a YAML or JSON file (JSON is YAML); PolicyError (path `$`) when it is not parseable."""
    file = Path(path)
    try:
        doc = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PolicyError("$", f"cannot read {file}: {e}") from None
    return parse_policy(doc, base_dir=file.parent)


def dump_policy(doc: Mapping[str, Any], as_json: bool = False) -> str:
    if as_json:
        return json.dumps(doc, indent=2)
    return yaml.safe_dump(dict(doc), sort_keys=False, allow_unicode=True)


def _plugins(raw: Any) -> dict[str, Plugin]:
    plugins: dict[str, Plugin] = {}
    for i, entry_raw in enumerate(validate.items(raw, "plugins")):
        path = validate.key_path("plugins", i)
        entry = validate.mapping(entry_raw, path)
        validate.known_keys(entry, path, ("type", "name", "parameters"), required=("type",))
        kind = validate.string(entry["type"], f"{path}.type")
        if kind not in PLUGIN_TYPES:
            raise PolicyError(
                f"{path}.type", f"unknown plugin type {kind!r} (known: {', '.join(PLUGIN_TYPES)})"
            )
        name = validate.string(entry.get("name", kind), f"{path}.name")
        if name in plugins:
            raise PolicyError(f"{path}.name", f"duplicate plugin name {name!r}")
        parameters = validate.mapping(entry.get("parameters", {}), f"{path}.parameters")
        try:
            plugins[name] = PLUGIN_TYPES[kind](name, parameters)
        except PolicyError as e:
            raise PolicyError(f"{path}.{e.path}", e.message) from None
    return plugins


def _profiles(raw: Any, plugins: Mapping[str, Plugin]) -> dict[str, Profile]:
    profiles: dict[str, Profile] = {}
    entries = validate.items(raw, "profiles")
    if not entries:
        raise PolicyError("profiles", "needs at least one profile")
    for i, entry_raw in enumerate(entries):
        path = validate.key_path("profiles", i)
        entry = validate.mapping(entry_raw, path)
        validate.known_keys(entry, path, ("name", "plugins"), required=("name", "plugins"))
        name = validate.string(entry["name"], f"{path}.name")
        if name in profiles:
            raise PolicyError(f"{path}.name", f"duplicate profile name {name!r}")
        profiles[name] = _profile(name, entry["plugins"], f"{path}.plugins", plugins)
    return profiles


def _profile(name: str, raw: Any, path: str, plugins: Mapping[str, Plugin]) -> Profile:
    filters: list[Filter] = []
    scorers: list[tuple[Scorer, float]] = []
    pickers: list[Picker] = []
    seen: set[str] = set()
    for j, ref_raw in enumerate(validate.items(raw, path)):
        where = validate.key_path(path, j)
        ref = validate.mapping(ref_raw, where)
        validate.known_keys(ref, where, ("ref", "weight"), required=("ref",))
        plugin_name = validate.string(ref["ref"], f"{where}.ref")
        plugin = plugins.get(plugin_name)
        if plugin is None:
            raise PolicyError(f"{where}.ref", f"no plugin named {plugin_name!r}")
        if plugin_name in seen:
            raise PolicyError(f"{where}.ref", f"{plugin_name!r} is already in this profile")
        seen.add(plugin_name)
        if "weight" in ref and not isinstance(plugin, Scorer):
            raise PolicyError(
                f"{where}.weight", f"only scorers take a weight; {plugin_name!r} is a {plugin.kind}"
            )
        if isinstance(plugin, Scorer):
            scorers.append((plugin, validate.positive(ref.get("weight", 1.0), f"{where}.weight")))
        elif isinstance(plugin, Filter):
            filters.append(plugin)
        elif isinstance(plugin, Picker):
            pickers.append(plugin)
    if len(pickers) != 1:
        raise PolicyError(path, f"a profile needs exactly one picker, found {len(pickers)}")
    return Profile(name, tuple(filters), tuple(scorers), pickers[0])


def _alias(name: str, raw: Any, profiles: Mapping[str, Profile]) -> Alias:
    path = validate.key_path("aliases", name)
    entry = _old_tiers_renamed(validate.mapping(raw, path), path)
    validate.known_keys(
        entry, path, ("rungs", "saturation_threshold", "shift_margin", "profile"), required=("rungs",)
    )
    rungs_raw = validate.items(entry["rungs"], f"{path}.rungs")
    if not rungs_raw:
        raise PolicyError(f"{path}.rungs", "needs at least one rung")
    rungs: list[Rung] = []
    for k, rung_raw in enumerate(rungs_raw):
        where = validate.key_path(f"{path}.rungs", k)
        rung = validate.mapping(rung_raw, where)
        validate.known_keys(rung, where, ("model", "max_score"), required=("model",))
        model = validate.string(rung["model"], f"{where}.model")
        last = k == len(rungs_raw) - 1
        if last and "max_score" in rung:
            raise PolicyError(f"{where}.max_score", "the last rung takes every higher score: leave it out")
        if not last and "max_score" not in rung:
            raise PolicyError(f"{where}.max_score", "is required on every rung but the last")
        max_score = None if last else validate.number(rung["max_score"], f"{where}.max_score", 0.0, 1.0)
        previous = rungs[-1].max_score if rungs else None
        if max_score is not None and previous is not None and max_score <= previous:
            raise PolicyError(f"{where}.max_score", f"must be above the previous rung's ({previous})")
        rungs.append(Rung(model, max_score))
    profile = entry.get("profile")
    if profile is not None and validate.string(profile, f"{path}.profile") not in profiles:
        raise PolicyError(f"{path}.profile", f"unknown profile {profile!r}")
    return Alias(
        name,
        tuple(rungs),
        validate.number(entry.get("saturation_threshold", 0.85), f"{path}.saturation_threshold", 0.0),
        validate.number(entry.get("shift_margin", 1.0), f"{path}.shift_margin", 0.0, 1.0),
        profile,
    )


def _old_tiers_renamed(entry: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """The alias entry with its rungs under `rungs`. Before the rename the field was `tiers`, and
    `lg:policy` keeps every stored version: an old active version must still load, and roll back."""
    if "tiers" not in entry:
        return entry
    if "rungs" in entry:
        raise PolicyError(f"{path}.tiers", "is the old name of `rungs`: give one of them")
    renamed = {k: v for k, v in entry.items() if k != "tiers"}
    renamed["rungs"] = entry["tiers"]
    return renamed
