"""loragate.proc with real processes: a spawned child dies with its parent even when the parent is
SIGKILLed, and a process that inherited SIGINT as ignored still stops on each stop signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import sys, time
from loragate.proc import spawn
child = spawn(["sleep", "600"])
print(child.pid, flush=True)
time.sleep(600)
"""

SUPERVISOR = """
import time
from loragate.proc import StopRequests
with StopRequests() as stops:
    print("ready", flush=True)
    while not stops.count:
        time.sleep(0.05)
    print("stopped by", stops.last, flush=True)
"""


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_spawned_child_dies_when_its_parent_is_sigkilled() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())  # bounded: the child prints at once or the test times out
        assert not _gone(child, 0.3)
        assert os.getpgid(child) == child  # a session of its own: a terminal's Ctrl-C reaches only the parent
        parent.kill()
        parent.wait(timeout=10)
        assert _gone(child, 5.0), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_stop_requests_count_every_stop_signal_even_with_sigint_ignored(sig: signal.Signals) -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child inherits SIGINT ignored
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0 and out.strip() == f"stopped by {int(sig)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
