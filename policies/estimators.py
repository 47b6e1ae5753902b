"""The policy document's `difficulty` section → an `Estimator`.

    difficulty: {estimator: heuristic, parameters: {code_weight: 0.6, ...}}   (the default)
    difficulty: {estimator: learned, path: difficulty.json}    a model from `loragate policy train-difficulty`
    difficulty: {estimator: learned, model: {...}}             the same model inline (the JSON it saved)

A relative `path` is read relative to `base_dir` (the policy file's folder) when given. Building the
learned estimator is the only file read a policy does, once per (re)load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policies import validate
from policies.difficulty import Estimator, HeuristicEstimator
from policies.difficulty_learned import LearnedEstimator
from policies.framework import PolicyError

ESTIMATORS = ("heuristic", "learned")


def build_estimator(raw: Any, path: str = "difficulty", base_dir: Path | None = None) -> Estimator:
    section: Mapping[str, Any] = validate.mapping(raw, path)
    validate.known_keys(section, path, ("estimator", "parameters", "path", "model"))
    kind = validate.string(section.get("estimator", "heuristic"), validate.key_path(path, "estimator"))
    if kind == "heuristic":
        for key in ("path", "model"):
            if key in section:
                raise PolicyError(validate.key_path(path, key), "applies to the learned estimator only")
        where = validate.key_path(path, "parameters")
        return HeuristicEstimator.from_parameters(
            validate.mapping(section.get("parameters", {}), where), where
        )
    if kind != "learned":
        raise PolicyError(validate.key_path(path, "estimator"), f"unknown estimator {kind!r} ({ESTIMATORS})")
    if "parameters" in section:
        raise PolicyError(validate.key_path(path, "parameters"), "the learned estimator takes none")
    if ("path" in section) == ("model" in section):
        raise PolicyError(path, "the learned estimator needs exactly one of 'path' and 'model'")
    if "model" in section:
        return _learned(section["model"], validate.key_path(path, "model"))
    where = validate.key_path(path, "path")
    file = Path(validate.string(section["path"], where))
    if base_dir is not None and not file.is_absolute():
        file = base_dir / file
    try:
        return _learned(json.loads(file.read_text()), where)
    except (OSError, json.JSONDecodeError) as e:
        raise PolicyError(where, f"cannot read {file}: {e}") from None


def _learned(model: Any, path: str) -> LearnedEstimator:
    try:
        return LearnedEstimator.from_dict(model)
    except ValueError as e:
        raise PolicyError(path, str(e)) from None
