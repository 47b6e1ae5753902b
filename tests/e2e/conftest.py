"""The end-to-end stack: real Redis, two real `tiny` workers, a real gateway on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, running_stack
from worker.modelzoo.make import ZooPaths


@pytest.fixture(scope="module")
def stack(
    zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    """The module's stack; a module may set `STACK_GATEWAY_CONFIG` (gateway config overrides)."""
    overrides = getattr(request.module, "STACK_GATEWAY_CONFIG", {})
    with running_stack(zoo, redis_server, Path(tmp_path_factory.mktemp("stack")), **overrides) as s:
        yield s
