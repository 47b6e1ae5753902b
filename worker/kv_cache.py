"""The paged KV pool: per layer, K and V tensors of `[num_blocks, block_size, kv_heads, head_dim]`, and how
big it is by default.

Sizing (`kv_budget`): an explicit `EngineConfig.kv_cache_bytes` wins. Otherwise the pool holds what
`max_num_seqs` sequences of `max_model_len` tokens would need, capped by memory: on a GPU a fraction of
what is free once the weights are loaded (vLLM's `gpu_memory_utilization` idea), on a CPU a fraction of
the memory available to this process (the host's, or its container's cgroup limit if lower). A fixed
pool was the first cause of preemptions on a real model (issue 15: a 512 MiB pool held 11,600 of
SmolLM2's fp32 tokens where 128 sequences needed 30,000).

On a CPU the pool is allocated as untouched zero pages (a private anonymous mapping): memory is committed
only as blocks are written, so a large pool costs nothing up front, and slots not yet written read as
zeros (the torch decode path multiplies masked slots by a zero probability, which needs them finite).

Committing the pool up front (`EngineConfig.kv_prefault`, on in `loragate worker`): first writes are slow
(on a VM ~2 s per GiB, a host-side fault behind each guest page), and a lazily committed pool pays them in
the first minutes of serving, on the token path; vLLM zeroes its pool at start. `prefault` commits every
page at construction instead (`MADV_POPULATE_WRITE`, Linux 5.14+, which leaves the contents alone; else by
writing the zeros), so the cost moves to start-up and a pool the machine cannot hold fails there, not
when it fills mid-service.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import math
import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

from worker.config import ModelConfig
from worker.device import is_cuda

log = logging.getLogger(__name__)

# Shares of the memory the KV pool may take by default (see the module docstring).
GPU_FREE_FRACTION = 0.85
CPU_AVAILABLE_FRACTION = 0.25
MIN_KV_BYTES = 64 * 1024**2
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+
MADV_HUGEPAGE = 14  # <linux/mman.h>
HUGE_PAGE = 2 * 1024**2  # a transparent huge page on x86-64 (and arm64 with 4 KiB pages)
PREFAULT_CHUNK = 256 * 1024**2


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def available_host_memory() -> int:
    """Bytes this process can still use: MemAvailable, or its cgroup's headroom if that is lower."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, available)


def kv_budget(
    cfg: ModelConfig,
    explicit: int | None,
    max_num_seqs: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: str,
) -> int:
    """The KV pool's size in bytes (see the module docstring)."""
    if explicit is not None:
        return explicit
    want = max_num_seqs * max_model_len * bytes_per_block(cfg, 1, dtype)
    if is_cuda(device):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        cap, where = int(free * GPU_FREE_FRACTION), f"{GPU_FREE_FRACTION:.0%} of free GPU memory"
    else:
        cap, where = (
            int(available_host_memory() * CPU_AVAILABLE_FRACTION),
            (f"{CPU_AVAILABLE_FRACTION:.0%} of available memory"),
        )
    budget = max(MIN_KV_BYTES, min(want, cap))
    log.info(
        "KV cache: %.0f MiB (%s; %d sequences of %d tokens would need %.0f MiB)",
        budget / 2**20,
        "all of that" if want <= cap else f"capped at {where}",
        max_num_seqs,
        max_model_len,
        want / 2**20,
    )
    return budget


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros; on a CPU as lazily committed zero pages (no write, no page touched, until used): a private
    anonymous mapping of its own, whatever malloc's settings (`worker.host_memory`), unmapped when the
    tensor goes. Private, not `mmap`'s default shared: a forked child writes into copies, never into this
    process's pool, and the pages are ordinary process memory, not shmem. A pool of 2 MiB or more starts
    on a 2 MiB boundary and asks for transparent huge pages (`MADV_HUGEPAGE`: where THP is `madvise` or
    `always`): the decode kernel reads each sequence's blocks from anywhere in the pool, and with 4 KiB
    pages nearly every block cost TLB misses (fp32 decode attention 1.19x faster on huge pages)."""
    if is_cuda(device) or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    huge = nbytes >= HUGE_PAGE
    size = max(1, nbytes + (HUGE_PAGE if huge else 0))
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.from_numpy(np.frombuffer(pages, dtype=np.uint8))  # the array holds the mapping
    start = -raw.data_ptr() % HUGE_PAGE if huge else 0
    if huge:
        # a hint: an error (THP off, an old kernel) leaves 4 KiB pages
        _madvise()(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    return raw[start : start + nbytes].view(dtype).view(shape)


def _madvise() -> ctypes._FuncPointer:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def prefault(tensors: list[torch.Tensor]) -> int:
    """Commit every page of these CPU tensors now (see the module docstring); returns the bytes committed.
    Each tensor is contiguous and starts on a page (as `_zeros` makes them). With `MADV_POPULATE_WRITE`
    their contents stay as they are; a kernel without it gets zeros written, so call this only on a pool
    that holds nothing yet. A failure to commit (ENOMEM, or the OOM killer) happens here, at start."""
    madvise: ctypes._FuncPointer | None = _madvise()
    page = mmap.PAGESIZE
    done = 0
    for t in tensors:
        if t.device.type != "cpu" or t.data_ptr() % page or not t.is_contiguous():
            raise ValueError("prefault takes contiguous, page-aligned CPU tensors")
        flat = t.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), PREFAULT_CHUNK):
            n = min(PREFAULT_CHUNK, flat.numel() - start)
            if (
                madvise is not None
                and madvise(flat.data_ptr() + start, (n + page - 1) // page * page, MADV_POPULATE_WRITE) != 0
            ):
                if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS):  # EINVAL: a kernel before 5.14
                    raise OSError(
                        ctypes.get_errno(), f"madvise(MADV_POPULATE_WRITE): {os.strerror(ctypes.get_errno())}"
                    )
                madvise = None
            if madvise is None:
                flat[start : start + n].zero_()  # only at construction: nothing lives in the pool yet
            done += n
    return done


class KVCache:
    """`num_blocks` blocks for sequences, plus `spare_blocks` after them that no sequence is ever given: a
    padded batch's dummy rows write their keys and values there (`pad_slot`, `worker.decode_graphs`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        spare_blocks: int = 0,
        prefault_pages: bool = False,
    ):
        shape = (cfg.num_layers, num_blocks + spare_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        if prefault_pages and self.k.device.type == "cpu":  # a GPU's `torch.zeros` has written its pool
            t0 = time.perf_counter()
            done = prefault([self.k, self.v])
            log.info("KV cache: %.0f MiB committed in %.1f s", done / 2**20, time.perf_counter() - t0)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spare_blocks = spare_blocks

    @property
    def pad_slot(self) -> int:
        """The first slot of the first spare block (a scratch slot no sequence's KV lives in)."""
        if not self.spare_blocks:
            raise ValueError("this KV pool has no spare block")
        return self.num_blocks * self.block_size
