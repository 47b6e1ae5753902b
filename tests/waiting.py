"""Waiting in tests for something another process or thread does, with a deadline and a clear failure."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    predicate: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.05
) -> None:
    """Poll `predicate` every `interval` seconds until it is truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
