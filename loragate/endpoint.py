"""Where a running `loragate up` answers: its base URL and dev API key, for clients on the same machine.

`up` writes `endpoint.json` into its run directory (mode 0600, like the gateway config that holds the same
key) once the stack is healthy; `loragate eval` and other local tools find the live instances there when
no `--base-url`/`OPENAI_BASE_URL` is given. A directory whose instance is gone (its lock is free) is not
live, whatever it still holds.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from loragate.rundir import LOCK

ENDPOINT_FILE = "endpoint.json"


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # the OpenAI base URL, ending in /v1
    api_key: str


def write_endpoint(state: Path, endpoint: Endpoint) -> Path:
    path = state / ENDPOINT_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"base_url": endpoint.base_url, "api_key": endpoint.api_key}, f)
    return path


def _alive(state: Path) -> bool:
    try:
        handle = (state / LOCK).open("a")
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # its instance holds the lock
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def live_endpoints(up_root: Path) -> list[Endpoint]:
    """The endpoints of the `up` instances alive under `up_root`, newest first."""
    found = []
    for path in up_root.glob(f"*/{ENDPOINT_FILE}") if up_root.is_dir() else []:
        if not _alive(path.parent):
            continue
        try:
            raw = json.loads(path.read_text())
            found.append((path.stat().st_mtime, Endpoint(str(raw["base_url"]), str(raw["api_key"]))))
        except (OSError, ValueError, KeyError):
            continue
    return [e for _, e in sorted(found, key=lambda item: item[0], reverse=True)]
