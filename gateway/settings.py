"""Gateway configuration: a YAML/JSON file plus environment overrides, validated once at start-up.

```yaml
admin_token: change-me            # or $LORAGATE_ADMIN_TOKEN
api_keys: {sk-dev-123: dev}       # API key -> tenant (more can be added at runtime via /admin/keys)
adapter_roots: [/models/adapters] # registered adapter paths must lie under one of these
request_timeout_s: 600
redis_timeout_s: 5                # a request that waits longer for Redis gets a 503
body_timeout_s: 30                # a request body must arrive within this, else 408
header_timeout_s: 10              # the request line and headers must arrive within this, else 408
fair_admission_per_worker: 0      # beyond this many outstanding per worker, tenants queue fairly (0: the
                                  # worker's own batch capacity, its --max-num-seqs)
# Overload (gateway/overload.py): refuse at once with 429 + Retry-After what would wait too long.
admission_wait_bound_s: 30        # estimated queue wait (requests ahead / measured drain rate); 0 = off
admission_max_queued: 0           # requests waiting (not running) per model; 0 = no limit
admission_models:                 # per-model overrides
  tiny: {wait_bound_s: 5, max_queued: 200}
admission_tenants:                # per-tenant overrides ("*" = every tenant); a tenant's wins
  batch-jobs: {wait_bound_s: 120} # over its model's, which wins over the defaults above
  "*": {max_queued: 100}          # a tenant's requests waiting in this gateway's fair queue
model_queue_max: 0                # requests per model waiting on its shared stream for any worker
                                  # (cold start, all workers full); 0 = off (503 / 429 instead)
# Per-worker queue bounds (429) and routing live in the routing policy (GET/PUT /admin/policy).
```
"""

from __future__ import annotations

import difflib
import json
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key, for the operator."""


@dataclass(frozen=True)
class GatewaySettings:
    redis_url: str
    admin_token: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    adapter_roots: tuple[Path, ...] = ()
    request_timeout_s: float = 600.0
    first_event_timeout_s: float = 300.0
    redis_timeout_s: float = 5.0  # longest wait for Redis on a request's path; then 503
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408), on every route
    header_timeout_s: float = 10.0  # the request line and headers must arrive within this (408)
    # Outstanding requests per worker before fair queueing starts; 0: each worker's own batch capacity
    # (its heartbeat's `max_running`, or DEFAULT_PER_WORKER when it does not say).
    fair_admission_per_worker: int = 0
    fair_admission_max_wait_s: float = 30.0
    admission_wait_bound_s: float = 30.0  # refuse (429) when the estimated queue wait exceeds it; 0 = off
    admission_max_queued: int = 0  # per model: requests waiting (not running) beyond which 429; 0 = off
    # Per base model: requests that may wait on its shared stream `lg:mq:{model}` while no worker can take
    # them (none live: scale from zero; all at their queue bound), for the first worker with room; 429
    # beyond. 0 = off: 503 with no worker, 429 when all are full.
    model_queue_max: int = 0
    admission_models: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> bounds
    admission_tenants: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant or "*" -> bounds
    gateway_id: str = field(default_factory=lambda: f"gw-{os.getpid()}")

    @staticmethod
    def load(redis_url: str, path: Path | None = None, **overrides: Any) -> GatewaySettings:
        """Settings from `path` (YAML, or JSON by suffix) and `overrides`; ConfigError names what is wrong."""
        raw: dict[str, Any] = _read(path) if path is not None else {}
        raw.update({k: v for k, v in overrides.items() if v is not None})
        if os.environ.get("LORAGATE_ADMIN_TOKEN"):
            raw["admin_token"] = os.environ["LORAGATE_ADMIN_TOKEN"]
        raw = _checked(raw, str(path) if path is not None else "gateway settings")
        roots = tuple(Path(p).resolve() for p in raw.pop("adapter_roots", ()))
        keys = {str(k): str(v) for k, v in raw.pop("api_keys", {}).items()}
        settings = GatewaySettings(redis_url=redis_url, adapter_roots=roots, api_keys=keys, **raw)
        from gateway.overload import Limits  # it reads these settings: imported late, no cycle

        try:  # nested admission bounds: a misspelled key is named with its file, not a traceback later
            Limits.from_settings(settings)
        except ValueError as err:
            raise ConfigError(f"{path if path is not None else 'gateway settings'}: {err}") from None
        return settings


# Fields a config file cannot set, and where their value comes from instead.
_NOT_IN_FILE = {"redis_url": "pass --redis URL or set REDIS_URL"}
# Keys older configs carry, and where the setting lives now.
_MOVED = {"max_queue_per_worker": "per-worker queue bounds live in the routing policy (PUT /admin/policy)"}


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file: {err}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:  # JSONDecodeError is a ValueError
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise ConfigError(f"{path}: not valid {kind}: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings (key: value), got {type(data).__name__}")
    return data


def _checked(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """`raw` validated against GatewaySettings' own fields, so a field added there is a config key at once:
    unknown keys (with the closest known one) and values of the wrong kind are errors; an empty value for
    a mapping or list field means its default."""
    hints = get_type_hints(GatewaySettings)
    known = sorted(f.name for f in fields(GatewaySettings) if f.name not in _NOT_IN_FILE)
    problems = []
    for key in raw:
        if key in _NOT_IN_FILE:
            problems.append(f"key {key!r} cannot be set in a config file: {_NOT_IN_FILE[key]}")
        elif key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            hint += f" ({_MOVED[key]})" if key in _MOVED else ""
            problems.append(f"unknown key {key!r}{hint}")
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}. Known keys: {', '.join(known)}")
    out = {}
    for key, value in raw.items():
        hint = hints[key]
        if value is None and get_origin(hint) in (dict, tuple):
            continue
        wanted = _wanted(value, hint)
        if wanted is not None:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ConfigError(f"{source}: key {key!r} must be {wanted}, got {shown}")
        out[key] = value
    return out


_SCALARS: dict[Any, tuple[str, tuple[type, ...]]] = {
    bool: ("true or false", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
    Path: ("a path", (str,)),
}


def _wanted(value: Any, hint: Any) -> str | None:
    """What `value` should have been for the type `hint`, or None when it fits (or the type is one this
    check does not know, which the dataclass then takes as it is)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        if value is None and len(options) < len(get_args(hint)):
            return None
        misses = [_wanted(value, a) for a in options]
        return None if None in misses else " or ".join(m for m in misses if m)
    args = [a for a in get_args(hint) if a is not Ellipsis]
    if origin is dict:
        if not isinstance(value, Mapping):
            return "a mapping (key: value)"
        inner = [_wanted(v, args[-1]) for v in value.values()] if args else []
        return next((f"a mapping whose every value is {m}" for m in inner if m), None)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            return "a list"
        inner = [_wanted(v, args[0]) for v in value] if len(args) == 1 else []
        return next((f"a list whose every item is {m}" for m in inner if m), None)
    if hint in _SCALARS:
        text, kinds = _SCALARS[hint]
        ok = isinstance(value, kinds) and (hint is bool or not isinstance(value, bool))
        return None if ok else text
    return None
