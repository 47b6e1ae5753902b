"""How an engine's process keeps the host memory it frees: for the next step, not for the kernel.

glibc's `malloc` serves a request above its mmap threshold (128 KiB at first, rising with what is freed,
at most 32 MiB) with a fresh `mmap` and unmaps it on `free`, and gives the top of its heap back to the
kernel once more than twice that lies free there. An engine step allocates and frees the same large
buffers every step — a prefill chunk's activations (8,192 tokens of `tiny`: a 45 MB gate/up projection;
of SmolLM2: 100 MB), a decode step's logits (128 sequences × SmolLM2's 49k vocabulary: 25 MB) — so each
step met them as new pages: a page fault and a zeroed 4 KiB page at a time, 70k faults in an
8,192-token prefill step of `tiny` (`loadtest.bench_host_memory`), where a matmul into a fresh output took
1.4–1.6× the same matmul into a reused one.

`keep_freed_memory` sets `M_MMAP_MAX` to 0 (large blocks come from the heap as well; a thread's arena that
cannot hold one falls back to the main heap) and `M_TRIM_THRESHOLD` out of reach (what is freed stays
mapped): a step's buffers reuse the last step's pages. The price is a resident size that stays at the
step buffers' high-water mark (+15 MB for SmolLM2, +60 MB for `tiny` at 8,192-token steps), which a
serving process reaches in its first busy seconds anyway, as caching allocators (PyTorch's on a GPU,
tcmalloc and jemalloc for vLLM on a CPU) keep theirs. What an engine holds for its lifetime, its weights
and KV pool, it allocates under `mapped_allocations`: large blocks in mappings of their own, returned whole
to the kernel when that engine goes (a process that builds engine after engine, as tests and benchmarks
do, does not keep the last one's pool). `LORAGATE_KEEP_FREED_MEMORY=0` leaves malloc's defaults (a
process that must give memory back between bursts).

malloc's settings belong to the whole process; they are set, never read back, so calling this again (every
engine does) changes nothing. Only glibc has them: elsewhere (musl, macOS, Windows) these do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
from collections.abc import Iterator

ENV = "LORAGATE_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
MMAP_MAX_DEFAULT = 65536  # glibc's DEFAULT_MMAP_MAX
TRIM_NEVER = 2**31 - 1  # mallopt takes an int: the largest is as good as never


def _mallopt() -> ctypes._FuncPointer | None:
    """glibc's `mallopt`, or None off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt


def _wanted(environ: dict[str, str] | os._Environ[str]) -> bool:
    return environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def keep_freed_memory(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Keep freed memory in this process for reuse (see the module). True when malloc took the settings;
    False off glibc or when `LORAGATE_KEEP_FREED_MEMORY=0`."""
    mallopt = _mallopt()
    if mallopt is None or not _wanted(environ):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_NEVER))


@contextlib.contextmanager
def mapped_allocations(environ: dict[str, str] | os._Environ[str] = os.environ) -> Iterator[None]:
    """Inside: large blocks get mappings of their own again (malloc's default), so what is allocated here
    for a long life goes back to the kernel whole when freed; after: `keep_freed_memory`."""
    mallopt = _mallopt()
    if mallopt is not None and _wanted(environ):  # opted out: no mallopt at all (one would end glibc's
        mallopt(M_MMAP_MAX, MMAP_MAX_DEFAULT)  # own adjusting of its mmap threshold)
    try:
        yield
    finally:
        keep_freed_memory(environ)
