"""A build lock is waited for a bounded time: a builder that holds it too long is a clear error naming the
lock and its holder, never a hang of `loragate up`, `models pull` or of the test suite's zoo fixture."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from loragate.file_lock import exclusive_lock

HOLDER = """
import sys, time
from pathlib import Path
from loragate.file_lock import exclusive_lock
with exclusive_lock(Path(sys.argv[1]), 600, "model zoo"):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_held_lock_is_waited_for_a_bounded_time_then_named(tmp_path: Path) -> None:
    lock = tmp_path / ".zoo-v1.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(TimeoutError) as err, exclusive_lock(lock, 1.0, "model zoo"):
            pass
        assert 1.0 <= time.monotonic() - started < 5.0
        assert str(lock) in str(err.value) and f"pid {holder.pid}" in str(err.value)
    finally:
        holder.kill()
        holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()
    with exclusive_lock(lock, 1.0, "model zoo"):  # released with its holder
        pass
