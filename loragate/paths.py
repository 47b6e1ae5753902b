"""Where loragate keeps built artefacts (demo models, adapters) between runs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: `$LORAGATE_CACHE`, else `~/.cache/loragate`."""
    root = os.environ.get("LORAGATE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "loragate"
