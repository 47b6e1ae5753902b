"""The model zoo's build lock is waited for a bounded time: a builder that holds it too long is a clear
error naming the lock and its holder, never a hang of `loragate up` or of the test suite's zoo fixture."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.modelzoo.make import _exclusive_lock

HOLDER = """
import sys, time
from pathlib import Path
from worker.modelzoo.make import _exclusive_lock
with _exclusive_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_held_lock_is_waited_for_a_bounded_time_then_named(tmp_path: Path) -> None:
    lock = tmp_path / ".zoo-v1.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(TimeoutError) as err, _exclusive_lock(lock, timeout_s=1.0):
            pass
        assert 1.0 <= time.monotonic() - started < 5.0
        assert str(lock) in str(err.value) and f"pid {holder.pid}" in str(err.value)
    finally:
        holder.kill()
        holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()
    with _exclusive_lock(lock, timeout_s=1.0):  # released with its holder
        pass
