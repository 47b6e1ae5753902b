"""Child processes a test starts at once and waits for within one deadline; any still running when the
test leaves (failed, timed out) are killed."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def started(
    commands: list[tuple[list[str], dict[str, str]]], cwd: Path
) -> Iterator[list[subprocess.Popen[str]]]:
    """Each `(argv, env)` started in `cwd`, its stdout and stderr piped as text; killed on exit if alive."""
    children: list[subprocess.Popen[str]] = []
    try:
        for argv, env in commands:
            children.append(
                subprocess.Popen(
                    argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def outputs(children: list[subprocess.Popen[str]], timeout_s: float) -> list[tuple[str, str]]:
    """Each child's `(stdout, stderr)` once it exits, all within `timeout_s` (else `TimeoutExpired`)."""
    deadline = time.monotonic() + timeout_s
    return [child.communicate(timeout=max(1.0, deadline - time.monotonic())) for child in children]
