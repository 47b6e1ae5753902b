"""The KV pool's default size (`worker.kv_cache.kv_budget`) and its lazily committed CPU allocation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import worker.kv_cache as kv_cache
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kv_cache import KVCache, bytes_per_block, kv_budget
from worker.models import load_model_config
from worker.modelzoo.make import ZooPaths


@pytest.fixture
def zoo_tiny(zoo: ZooPaths) -> Path:
    return zoo.base("tiny")


def test_an_explicit_size_wins(zoo_tiny: Path) -> None:
    cfg = load_model_config(zoo_tiny)
    assert kv_budget(cfg, 123 * 2**20, 128, 2048, torch.float32, "cpu") == 123 * 2**20


def test_by_default_full_length_sequences_fit_when_memory_allows(
    zoo_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_model_config(zoo_tiny)
    per_token = bytes_per_block(cfg, 1, torch.float32)
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 10**12)
    assert kv_budget(cfg, None, 16, 1000, torch.float32, "cpu") == max(
        kv_cache.MIN_KV_BYTES, 16 * 1000 * per_token
    )
    # Less memory: a quarter of what is available.
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 4 * 2**30)
    assert kv_budget(cfg, None, 128, 10**6, torch.float32, "cpu") == 2**30
    # Never below the floor.
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 0)
    assert kv_budget(cfg, None, 128, 2048, torch.float32, "cpu") == kv_cache.MIN_KV_BYTES


def test_available_memory_is_positive_and_bounded_by_the_machine() -> None:
    import os

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < kv_cache.available_host_memory() <= total


def test_the_engine_sizes_its_pool_from_the_budget(zoo_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 10**12)
    engine = LLMEngine(zoo_tiny, EngineConfig(max_num_seqs=4, max_model_len=256))
    per_block = bytes_per_block(engine.model_config, engine.config.block_size, torch.float32)
    want = max(kv_cache.MIN_KV_BYTES, 4 * 256 * bytes_per_block(engine.model_config, 1, torch.float32))
    assert engine.kv.num_blocks == want // per_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_cpu_pool_reads_as_zeros_and_is_not_committed_up_front(zoo_tiny: Path, dtype: torch.dtype) -> None:
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    cfg = load_model_config(zoo_tiny)
    blocks = (1 << 30) // bytes_per_block(cfg, 16, dtype)  # a 1 GiB pool
    before = rss()
    kv = KVCache(cfg, blocks, 16, dtype, "cpu")
    assert rss() - before < 64 * 2**20  # pages are committed when written, not now
    assert kv.k.shape == (cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim) and kv.k.dtype == dtype
    assert not kv.k[:, :: max(1, blocks // 7)].any() and not kv.v[:, -1].any()
    kv.k[0, 3] = 1.0  # writable
    assert kv.k[0, 3].all()
