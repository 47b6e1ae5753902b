"""Shared fixtures: the demo model zoo (built once into the cache) and HF references per base model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from worker.modelzoo.make import ZooPaths, ensure_zoo


@pytest.fixture(scope="session")
def zoo() -> ZooPaths:
    return ensure_zoo()


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
