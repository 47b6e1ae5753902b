"""The end-to-end stack: real Redis, two real `tiny` workers, a real gateway on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.e2e.stack import Stack
from worker.modelzoo.make import ZooPaths


@pytest.fixture(scope="module")
def stack(
    zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    """The module's stack; a module may set `STACK_GATEWAY_CONFIG` (gateway config overrides)."""
    client = redis.Redis.from_url(redis_server, socket_timeout=10, socket_connect_timeout=10)
    client.flushall()
    client.close()
    overrides = getattr(request.module, "STACK_GATEWAY_CONFIG", {})
    s = Stack(zoo, redis_server, Path(tmp_path_factory.mktemp("stack")), **overrides)
    try:
        s.start_worker("w1")
        s.start_worker("w2")
        s.start_gateway()
        s.wait_ready(workers=2)
        yield s
    finally:
        s.stop()
