"""Process helpers for end-to-end tests: a process's descendants and their state (from /proc), and its
output read by a thread so that every wait for a line has a deadline."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import IO


def descendants(pid: int) -> set[int]:
    """Live processes below `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def command_lines(pids: set[int]) -> str:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return "\n".join(out)


class Output:
    """A process's output, read by a thread: `wait_for` has a deadline, where a bare readline() blocks as
    long as the process (or any child still holding the pipe) stays silent."""

    def __init__(self, stream: IO[str]):
        self.lines: list[str] = []
        self.closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.closed = True  # EOF: every process holding the pipe is gone
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str] | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if match := re.search(pattern, line):
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self._cond.wait(left)

    def wait_closed(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return self.closed

    def text(self) -> str:
        with self._cond:
            return "".join(self.lines)
