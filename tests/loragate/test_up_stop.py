"""`loragate up`'s stop (`loragate.up._stop`) on real child processes that take their time to drain: a
second stop signal kills them at once, even one that came before the stop began; without one they get
the grace period, then are killed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from loragate.proc import StopRequests
from loragate.up import _stop

# A child that drains forever: it ignores SIGTERM, as a worker with work left keeps running on it.
DRAINING = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(60)"
)


def draining_child() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", DRAINING], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


@pytest.mark.parametrize(
    ("signals_before", "killed_within_s", "said"),
    [
        pytest.param(2, 2.0, "killing…", id="second signal before the stop began: killed at once"),
        pytest.param(1, 5.0, "still running after", id="one signal: drained for the grace, then killed"),
    ],
)
def test_a_stop_kills_what_outlasts_it(
    signals_before: int, killed_within_s: float, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    child = draining_child()
    stops = StopRequests()
    stops.count = signals_before
    started = time.monotonic()
    try:
        _stop({"child": child}, stops, grace_s=1.5)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    took = time.monotonic() - started
    assert took < killed_within_s
    if signals_before == 1:
        assert took >= 1.5  # it had its grace
    assert child.returncode == -9
    assert said in capsys.readouterr().err
