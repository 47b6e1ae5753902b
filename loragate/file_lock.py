"""An exclusive lock file that serialises the builders of one cache entry, waited for a bounded time.

Whoever builds something into the cache (the model zoo, a pulled model) holds the lock while it builds;
a second process waits, then finds the finished entry. The holder writes its pid into the file, so a
builder that is stuck (or stopped) is named in a clear error instead of hanging everyone behind it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive_lock(path: Path, timeout_s: float, what: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing); `what` names the build in errors."""
    with path.open("a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    raise TimeoutError(
                        f"waited {timeout_s:.0f} s for the {what} lock {path}, "
                        f"held by another build (pid {holder}) that seems stuck"
                    ) from None
                time.sleep(0.2)
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
