"""A stack file for `loragate up -c stack.yaml`: which models to serve, how, and who may call them.

```yaml
host: 127.0.0.1            # default 127.0.0.1
port: 8000                 # default 8000
admin_token: change-me     # default: generated at start (printed in the banner)
api_keys: {sk-team-a: team-a}          # API key -> tenant; default: one generated key of tenant "dev"
models:                    # at least one; each is served by its own workers
  - name: smollm2          # the name clients use (default: the path's last part); adapters are name:task
    path: smollm2          # a checkpoint directory, or a name loragate fetches or builds (stack_sources)
    adapters: ./adapters   # PEFT adapters, one per subfolder (default: a named model's shipped ones)
    workers: 2             # default 1
    device: auto           # auto | cpu | cuda | cuda:N (default: the worker's, auto)
    dtype: auto            # auto | float32 | bfloat16 | float16 (default: the worker's, auto)
    kv_cache_mb: 1024      # each worker's KV cache, MiB (default: the worker's, sized to free memory)
    pin: [upper]           # adapters kept resident on every worker of this model
auto:                      # rungs of the `auto` alias (policy syntax); default: every request to models[0]
  - {max_score: 0.4, model: tiny}
  - {model: smollm2}
```

Validated whole before anything starts: an unknown key (with the closest known one), a value of the wrong
kind, a checkpoint without config.json, a rung naming a model the stack does not serve each raise
`StackError` naming the file and the key path (`stack.yaml: models[1].workers: must be an integer ≥ 1`).
Relative paths are relative to the file. A hand validator rather than pydantic: the schema is two levels
deep, the messages follow the gateway config's (gateway/settings.py: same "did you mean", same key
naming), and `up`'s process takes no new dependency.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loragate import stack_sources

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?", re.IGNORECASE)  # as worker.device reads it
DTYPES = ("auto", "float32", "bfloat16", "float16")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # no ':' (base:adapter), no '/'
_TOP = ("host", "port", "admin_token", "api_keys", "models", "auto")
_MODEL = ("name", "path", "adapters", "workers", "device", "dtype", "kv_cache_mb", "pin")


class StackError(ValueError):
    """A stack that cannot be served; the message names the file (or flag) and the key path."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # a checkpoint directory, or a name from stack_sources (PULLED, BUILT)
    adapters: Path | None = None
    workers: int = 1
    device: str | None = None  # None: the worker's default
    dtype: str | None = None
    pin: tuple[str, ...] = ()
    kv_cache_mb: int | None = None  # None: the worker's default

    @property
    def checkpoint(self) -> Path:
        return stack_sources.checkpoint_dir(self.source)


@dataclass(frozen=True)
class StackConfig:
    models: tuple[ModelSpec, ...]
    auto: tuple[Mapping[str, Any], ...]  # the `auto` alias's rungs, as in a policy document
    api_keys: Mapping[str, str] = field(default_factory=dict)  # empty: `up` generates a dev key
    admin_token: str | None = None  # None: `up` generates one
    host: str = "127.0.0.1"
    port: int = 8000

    @property
    def workers(self) -> int:
        return sum(m.workers for m in self.models)


def load_stack(path: Path) -> StackConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise StackError(f"{path}: cannot read the stack file: {err}") from None
    except yaml.YAMLError as err:
        raise StackError(f"{path}: not valid YAML: {err}") from None
    return parse_stack(raw, str(path), path.resolve().parent)


def parse_stack(raw: Any, source: str, base_dir: Path) -> StackConfig:
    """`raw` (a parsed YAML document) checked whole; `source` prefixes every message."""
    top = _mapping(raw, "", _TOP, source)
    if "models" not in top:
        raise StackError(f"{source}: models: is required (a list of models to serve)")
    if not isinstance(top["models"], list) or not top["models"]:
        raise StackError(f"{source}: models: must be a non-empty list of models")
    models = tuple(_model(m, f"models[{i}]", source, base_dir) for i, m in enumerate(top["models"]))
    names = [m.name for m in models]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise StackError(f"{source}: models[{i}].name: {name!r} is already the name of another model")
    keys = top.get("api_keys", {})
    if not isinstance(keys, dict) or not all(_text(k) and _text(v) for k, v in keys.items()):
        raise StackError(f"{source}: api_keys: must be a mapping of API key to tenant (non-empty strings)")
    admin = top.get("admin_token")
    if admin is not None and not _text(admin):
        raise StackError(f"{source}: admin_token: must be a non-empty string")
    host = top.get("host", "127.0.0.1")
    if not _text(host):
        raise StackError(f"{source}: host: must be a host name or address")
    port = top.get("port", 8000)
    if not _integer(port) or not 1 <= port <= 65535:
        raise StackError(f"{source}: port: must be an integer from 1 to 65535, got {port!r}")
    auto = check_rungs(top.get("auto"), names, source) if "auto" in top else ({"model": names[0]},)
    return StackConfig(models, auto, dict(keys), admin, host, port)


def check_rungs(raw: Any, served: list[str], source: str) -> tuple[Mapping[str, Any], ...]:
    """The `auto` rungs, validated as the policy validates an alias, each naming a served model."""
    from policies.default_policy import DEFAULT_POLICY
    from policies.document import parse_policy  # numpy, not torch: only when a file has rungs
    from policies.framework import PolicyError

    prefix = "aliases.auto.rungs"
    try:
        parse_policy(with_auto(DEFAULT_POLICY, raw))
    except PolicyError as err:
        where = "auto" + err.path[len(prefix) :] if err.path.startswith(prefix) else "auto"
        raise StackError(f"{source}: {where}: {err.message}") from None
    for k, rung in enumerate(raw):
        if rung["model"] not in served:
            known = ", ".join(served)
            raise StackError(
                f"{source}: auto[{k}].model: {rung['model']!r} is not a model of this stack ({known})"
            )
    return tuple(dict(t) for t in raw)


def with_auto(policy: Mapping[str, Any], rungs: Any) -> dict[str, Any]:
    """A copy of the policy document `policy` whose `auto` alias has these rungs (its other settings kept;
    rungs stored under the field's old name, `tiers`, are replaced)."""
    doc = copy.deepcopy(dict(policy))
    aliases = doc.setdefault("aliases", {})
    kept = {k: v for k, v in aliases.get("auto", {}).items() if k != "tiers"}
    aliases["auto"] = {**kept, "rungs": copy.deepcopy(rungs)}
    return doc


def _model(raw: Any, where: str, source: str, base_dir: Path) -> ModelSpec:
    m = _mapping(raw, where, _MODEL, source)
    if not _text(m.get("path")):
        raise StackError(f"{source}: {where}.path: is required (a checkpoint directory or a model name)")
    path = str(m["path"])
    named = stack_sources.is_named(path)
    model_source = path if named else str((base_dir / path).resolve())
    if not named:
        check_checkpoint(Path(model_source), f"{source}: {where}.path")
    name = m.get("name", path if named else Path(model_source).name)
    if not isinstance(name, str) or not NAME.fullmatch(name) or name == "auto":
        allowed = "letters, digits, '.', '_' and '-' (no ':' or '/'), not 'auto'"
        raise StackError(f"{source}: {where}.name: {name!r} is not a model name ({allowed})")
    if "adapters" in m and not _text(m["adapters"]):
        raise StackError(f"{source}: {where}.adapters: must be a directory")
    adapters = stack_sources.shipped_adapters(path)
    if adapters is not None and path in stack_sources.PULLED and not adapters.is_dir():
        raise StackError(f"{source}: {where}.path: {path}'s shipped adapters are missing ({adapters})")
    if "adapters" in m:
        adapters = (base_dir / m["adapters"]).resolve()
        if not adapters.is_dir():
            raise StackError(f"{source}: {where}.adapters: {adapters} is not a directory")
    workers = m.get("workers", 1)
    if not _integer(workers) or workers < 1:
        raise StackError(f"{source}: {where}.workers: must be an integer ≥ 1, got {workers!r}")
    device, dtype = m.get("device"), m.get("dtype")
    if device is not None and not (isinstance(device, str) and DEVICE.fullmatch(device)):
        raise StackError(f"{source}: {where}.device: must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dtype is not None and dtype not in DTYPES:
        raise StackError(f"{source}: {where}.dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    kv_cache_mb = m.get("kv_cache_mb")
    if kv_cache_mb is not None and (not _integer(kv_cache_mb) or kv_cache_mb < 1):
        raise StackError(f"{source}: {where}.kv_cache_mb: must be an integer ≥ 1 (MiB), got {kv_cache_mb!r}")
    pin = m.get("pin", [])
    if not isinstance(pin, list) or not all(_text(p) for p in pin):
        raise StackError(f"{source}: {where}.pin: must be a list of adapter names")
    if len(set(pin)) != len(pin):
        raise StackError(f"{source}: {where}.pin: names an adapter more than once")
    for k, adapter in enumerate(pin):
        if adapters is None or (
            adapters.is_dir() and not (adapters / adapter / "adapter_config.json").is_file()
        ):
            raise StackError(f"{source}: {where}.pin[{k}]: no adapter {adapter!r} in {adapters}")
    return ModelSpec(name, model_source, adapters, workers, device, dtype, tuple(pin), kv_cache_mb)


def check_adapters(model: ModelSpec) -> None:
    """StackError unless the model's adapter folder exists and holds every pinned adapter (a named model's
    shipped folder may only exist once it was built, so `up` checks again after building)."""
    if model.adapters is None:
        return
    if not model.adapters.is_dir():
        raise StackError(f"{model.name}: its adapters folder {model.adapters} is not a directory")
    for adapter in model.pin:
        if not (model.adapters / adapter / "adapter_config.json").is_file():
            raise StackError(f"{model.name}: pinned adapter {adapter!r} is not in {model.adapters}")


def check_checkpoint(directory: Path, what: str) -> None:
    """StackError unless `directory` looks like a Hugging Face checkpoint (exists, has config.json)."""
    if not directory.is_dir():
        raise StackError(f"{what}: {directory} is not a directory (nor a model name: {_names()})")
    if not (directory / "config.json").is_file():
        raise StackError(f"{what}: {directory} has no config.json (not a Hugging Face checkpoint)")


def _names() -> str:
    return ", ".join((*stack_sources.PULLED, *stack_sources.BUILT))


def _mapping(raw: Any, where: str, known: tuple[str, ...], source: str) -> dict[str, Any]:
    label = f"{where}: " if where else ""
    if not isinstance(raw, dict):
        raise StackError(f"{source}: {label}must be a mapping (key: value), got {type(raw).__name__}")
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            path = f"{where}.{key}" if where else str(key)
            raise StackError(f"{source}: {path}: unknown key{hint}; known keys: {', '.join(known)}")
    return raw


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
