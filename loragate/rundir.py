"""A run directory per `loragate up` instance: `<root>/<port>-<id>/`, locked while the instance lives.

The instance keeps everything it writes there (the gateway config with its dev key, the embedded Redis's
socket and append-only file), so instances on one machine share nothing. The directory is removed when
the instance exits; one left behind by an instance that was SIGKILLed is recognised by its lock being
free (the kernel drops an flock with its holder) and removed by the next instance that starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

LOCK = "instance.lock"


def remove_stale(root: Path) -> list[Path]:
    """Remove the run directories under `root` whose instance is gone; returns them."""
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        lock = path / LOCK
        if not lock.is_file():  # not a run directory, or one still being created
            continue
        try:
            handle = lock.open("a")
        except OSError:
            continue
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its instance is alive
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def run_dir(root: Path, port: int) -> Iterator[tuple[str, Path]]:
    """Create, lock and yield (instance id, directory); remove the directory on exit."""
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    while True:
        instance = secrets.token_hex(3)
        path = root / f"{port}-{instance}"
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        handle = (path / LOCK).open("a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        # Another instance's `remove_stale` may have taken the new lock before we did and removed the
        # directory: then ours is an unlinked file, and we start over.
        if (path / LOCK).is_file():
            break
        handle.close()
    try:
        yield instance, path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        handle.close()
