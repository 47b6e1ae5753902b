"""Build the whole model zoo once, into the cache or a given folder, safely under concurrency.

`make_all` is what `loragate models make` runs and `ensure_zoo` what tests and benchmarks call. The
zoo is built into a temporary sibling folder and renamed into place, with `manifest.json` written
last, so a folder with a manifest is always complete. A lock file next to the output serialises
builders: a second process waits, then finds the manifest and returns at once.

Layout (under the root):

    manifest.json                      specs, adapter names and a SHA-256 for every file
    <base>/                            config.json, generation_config.json, model.safetensors,
                                       tokenizer.json, tokenizer_config.json, chat_template.jinja
    adapters/<base>/<adapter>/         adapter_config.json, adapter_model.safetensors
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loragate.file_lock import exclusive_lock
from loragate.paths import cache_dir
from worker.modelzoo.base_specs import BASE_SPECS, base_spec

# The builders (torch, transformers, peft: 10 s of imports) are imported by the functions that build, so
# that `loragate models make` on a complete zoo, which `loragate up` runs at every start, returns at once.

# Bump when the artefacts change, so an old cache is not mistaken for the current zoo.
ZOO_VERSION = 1
MANIFEST = "manifest.json"
ALL_BASES: tuple[str, ...] = tuple(spec.name for spec in BASE_SPECS)


@dataclass(frozen=True)
class ZooPaths:
    """Where the artefacts of a built zoo lie."""

    root: Path

    def base(self, name: str) -> Path:
        """The folder of base model `name` (a `from_pretrained` checkpoint with its tokenizer)."""
        return self.root / name

    def adapter(self, base: str, name: str) -> Path:
        """The folder of adapter `name` for `base` (a `PeftModel.from_pretrained` checkpoint)."""
        return self.root / "adapters" / base / name

    def manifest(self) -> dict[str, Any]:
        """The parsed `manifest.json`."""
        parsed: dict[str, Any] = json.loads((self.root / MANIFEST).read_text())
        return parsed

    def adapter_names(self, base: str) -> list[str]:
        """The adapters built for `base`, in spec order; empty for a base without adapters."""
        return list(self.manifest()["adapters"].get(base, {}))


def default_root() -> Path:
    """Where `make_all` builds when given no folder."""
    return cache_dir() / f"zoo-v{ZOO_VERSION}"


def step_count(bases: Sequence[str] = ALL_BASES) -> int:
    """How many steps `build_into` yields for `bases` (one per tokenizer, base and adapter)."""
    from worker.modelzoo.adapters import ADAPTER_SPECS

    return 1 + len(bases) + sum(len(ADAPTER_SPECS.get(name, ())) for name in bases)


def build_into(root: Path, bases: Sequence[str] = ALL_BASES) -> Iterator[str]:
    """Build the zoo for `bases` into the empty folder `root`, yielding a label after each step.

    The manifest is written after the last step; `make_all` adds the locking and atomic rename.
    """
    from worker.modelzoo.adapters import ADAPTER_SPECS, build_adapter
    from worker.modelzoo.bases import build_base
    from worker.modelzoo.tokenizer import build_tokenizer

    paths = ZooPaths(root)
    tokenizer = build_tokenizer()
    yield "tokenizer"
    for name in bases:
        model = build_base(base_spec(name), tokenizer, paths.base(name))
        yield name
        for spec in ADAPTER_SPECS.get(name, ()):
            build_adapter(model, name, spec, paths.adapter(name, spec.name))
            yield f"{name}/{spec.name}"
    write_manifest(root, bases)


def write_manifest(root: Path, bases: Sequence[str]) -> None:
    """Record the specs and a hash of every file; written last, it marks the zoo complete."""
    from worker.modelzoo.adapters import ADAPTER_SPECS

    manifest = {
        "format": "loragate-modelzoo",
        "version": ZOO_VERSION,
        "bases": {name: dataclasses.asdict(base_spec(name)) for name in bases},
        "adapters": {
            name: {spec.name: dataclasses.asdict(spec) for spec in ADAPTER_SPECS.get(name, ())}
            for name in bases
        },
        "files": file_hashes(root),
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def file_hashes(root: Path) -> dict[str, str]:
    """SHA-256 of every file under `root`, by path relative to it, in sorted order."""
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def is_complete(root: Path, bases: Sequence[str] = ALL_BASES) -> bool:
    """Whether `root` holds a finished zoo of the current version with at least `bases` in it."""
    try:
        manifest = ZooPaths(root).manifest()
    except (OSError, ValueError):
        return False
    return manifest.get("version") == ZOO_VERSION and set(bases) <= set(manifest.get("bases", {}))


# A build takes ~10 s; a builder holding the lock far longer is stuck (or stopped), and waiting for it
# forever would hang `loragate up` and the test suite instead of saying so.
LOCK_TIMEOUT_S = 120.0


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # transformers draws a bar per saved checkpoint, which would shred our single build bar.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def make_all(out: Path | None = None, progress: bool = True, *, bases: Sequence[str] = ALL_BASES) -> ZooPaths:
    """Build the tokenizer, `bases` (default: all) and their adapters into `out` (or `default_root()`).

    Returns at once when `out` already holds a complete zoo. Safe to call from several processes.
    """
    root = (out if out is not None else default_root()).absolute()
    if is_complete(root, bases):
        return ZooPaths(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root.parent / f".{root.name}.lock", LOCK_TIMEOUT_S, "model zoo"):
        if is_complete(root, bases):  # another process finished it while we waited
            return ZooPaths(root)
        _remove_stale_builds(root)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
        try:
            bar = tqdm(total=step_count(bases), desc="model zoo", disable=not progress)
            with _quiet_transformers(), bar:
                for label in build_into(staging, bases):
                    bar.set_postfix_str(label)
                    bar.update()
            _make_readable(staging)
            # An incomplete or outdated zoo; nobody else writes it while we hold the lock.
            if root.exists():
                shutil.rmtree(root)
            os.rename(staging, root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return ZooPaths(root)


def _make_readable(root: Path) -> None:
    # mkdtemp and safetensors create private (0700/0600) entries; the cache is meant to be shared.
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _remove_stale_builds(root: Path) -> None:
    # Only a builder killed mid-build leaves these, and we hold the lock, so none is in use.
    for stale in root.parent.glob(f".{root.name}.building-*"):
        shutil.rmtree(stale, ignore_errors=True)


def ensure_zoo() -> ZooPaths:
    """The zoo in the cache, built quietly on first use; for tests and benchmarks."""
    return make_all(None, progress=False)
