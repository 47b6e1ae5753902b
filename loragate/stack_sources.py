"""Where a stack's base models come from: a local checkpoint directory, or a name loragate can fetch or build.

A model's `path` in a stack (or `loragate up --model`) is either a directory holding a Hugging Face
checkpoint (`config.json`, safetensors, `tokenizer.json`), or one of these names:

- `smollm2` (`PULLED`): fetched and converted by `loragate models pull smollm2` into
  `<cache>/models/smollm2`, served with the adapters shipped in `worker/modelzoo/smollm2_adapters/`;
- `tiny`, `small` (`BUILT`): the project's toy models, built by `loragate models make` into
  `<cache>/zoo-v1/`, each with its ten toy adapters.

A name wins over a directory of the same name in the working directory; write `./tiny` for that one.
`up` runs the commands `prepare_commands` lists as child processes before anything else starts. This module
imports nothing heavy (no torch): `up` stays a light supervisor.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path

from loragate.paths import cache_dir

PULLED = ("smollm2",)  # = worker.hub.pull.PULLABLE (tests/loragate/test_up_args.py checks)
BUILT = ("tiny", "small")
ZOO = "zoo-v1"  # the folder `loragate models make` builds under the cache (worker.modelzoo.make)


def is_named(source: str) -> bool:
    return source in PULLED or source in BUILT


def checkpoint_dir(source: str) -> Path:
    """The checkpoint directory a source names (for a name: where its pull or build puts it)."""
    if source in PULLED:
        return cache_dir() / "models" / source
    if source in BUILT:
        return cache_dir() / ZOO / source
    return Path(source)


def shipped_adapters(source: str) -> Path | None:
    """The adapters that come with a named model (None for a directory: the user names theirs)."""
    if source in BUILT:
        return cache_dir() / ZOO / "adapters" / source
    if source in PULLED:
        spec = importlib.util.find_spec("worker.modelzoo")  # its folder, without importing it
        assert spec is not None and spec.submodule_search_locations is not None
        return Path(next(iter(spec.submodule_search_locations))) / f"{source}_adapters"
    return None


def prepare_commands(sources: Iterable[str]) -> list[list[str]]:
    """The `loragate` commands (arguments) that fetch or build the named sources, each once."""
    names = list(dict.fromkeys(sources))
    commands = [["models", "pull", name] for name in names if name in PULLED]
    if any(name in BUILT for name in names):
        commands.append(["models", "make"])
    return commands


def adapter_names(directory: Path | None) -> list[str]:
    """The adapters a worker registers from `directory`: its subfolders holding an adapter_config.json."""
    if directory is None or not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if (p / "adapter_config.json").is_file())
