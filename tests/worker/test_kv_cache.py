"""The KV pool's default size (`worker.kv_cache.kv_budget`) and its lazily committed CPU allocation."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
from pathlib import Path

import pytest
import torch

import worker.kv_cache as kv_cache
from loadtest.bench_decode_pool import smaps_entry
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


def _resident(t: torch.Tensor) -> float:
    """The share of `t`'s pages in memory (`mincore`)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    page = 4096
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


@pytest.mark.parametrize("populate", [True, False], ids=["madvise", "writing-zeros"])
def test_a_prefaulted_pool_is_committed_at_start_and_keeps_its_contents(
    zoo_tiny: Path, monkeypatch: pytest.MonkeyPatch, populate: bool
) -> None:
    if not populate:  # a kernel before 5.14 answers MADV_POPULATE_WRITE with EINVAL: zeros are written
        real = kv_cache._madvise()

        def old_kernel(addr: int, length: int, advice: int) -> int:
            if advice == kv_cache.MADV_POPULATE_WRITE:
                ctypes.set_errno(errno.EINVAL)
                return -1
            return int(real(addr, length, advice))

        monkeypatch.setattr(kv_cache, "_madvise", lambda: old_kernel)
    cfg = load_model_config(zoo_tiny)
    blocks = (256 * 2**20) // bytes_per_block(cfg, 16, torch.float32)  # 256 MiB: past one prefault chunk
    kv = KVCache(cfg, blocks, 16, torch.float32, "cpu", prefault_pages=True)
    assert _resident(kv.k) == _resident(kv.v) == 1.0  # every page is in memory now
    assert not kv.k[:, :: max(1, blocks // 7)].any() and not kv.v[:, -1].any()
    kv.k[1, 5] = 2.5
    kv.v[-1, -1] = -1.0
    if populate:  # the populate path never writes: a live pool's contents survive it
        assert kv_cache.prefault([kv.k, kv.v]) == 256 * 2**20
        assert (kv.k[1, 5] == 2.5).all() and (kv.v[-1, -1] == -1.0).all()
        assert int(kv.k.ne(0).sum()) == kv.k[1, 5].numel()


def test_prefault_refuses_what_it_cannot_commit_whole() -> None:
    with pytest.raises(ValueError, match="page-aligned"):
        kv_cache.prefault([torch.zeros(1 << 20)[1:]])  # not on a page boundary


def test_an_engine_commits_its_pool_when_asked(zoo_tiny: Path) -> None:
    lazy = LLMEngine(zoo_tiny, EngineConfig(kv_cache_bytes=64 * 2**20))
    assert _resident(lazy.kv.k) < 0.05
    eager = LLMEngine(zoo_tiny, EngineConfig(kv_cache_bytes=64 * 2**20, kv_prefault=True))
    assert _resident(eager.kv.k) == _resident(eager.kv.v) == 1.0


def test_the_worker_commits_its_pool_by_default() -> None:
    from worker.main import build_parser

    assert build_parser().parse_args(["--model", "m"]).kv_prefault == "on"
    assert build_parser().parse_args(["--model", "m", "--kv-prefault", "off"]).kv_prefault == "off"


def test_a_cpu_pool_starts_on_a_huge_page_and_asks_for_huge_pages(zoo_tiny: Path) -> None:
    """The decode kernel reads blocks from anywhere in the pool: 2 MiB pages (`MADV_HUGEPAGE`, VmFlags `hg`)
    spare it a TLB miss on nearly every block. A pool under 2 MiB is left as it is."""
    cfg = load_model_config(zoo_tiny)

    def flags(t: torch.Tensor) -> list[str]:
        return smaps_entry(t)[1]["VmFlags"].split()

    big = KVCache(cfg, (64 * 2**20) // bytes_per_block(cfg, 16, torch.float32), 16, torch.float32, "cpu")
    small = KVCache(cfg, 4, 16, torch.float32, "cpu")
    for t in (big.k, big.v):
        assert t.data_ptr() % kv_cache.HUGE_PAGE == 0 and "hg" in flags(t)
        assert not t[:, :: max(1, t.shape[1] // 5)].any()
    assert "hg" not in flags(small.k)


def test_a_cpu_pool_is_private_memory(zoo_tiny: Path) -> None:
    """Not shared with a forked child (`mmap`'s default for an anonymous map is shared)."""
    cfg = load_model_config(zoo_tiny)
    kv = KVCache(cfg, 64, 16, torch.float32, "cpu")
    for t in (kv.k, kv.v):
        addr = t.data_ptr()
        for line in Path("/proc/self/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                assert line.split()[1] == "rw-p", line
                break
        else:
            raise AssertionError("the pool's mapping is not in /proc/self/maps")
