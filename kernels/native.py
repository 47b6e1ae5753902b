"""Native CPU kernels (C++ in `kernels/csrc/`): built once per machine with the system compiler, loaded
as torch custom ops (`torch.ops.loragate_cpu.*`).

Why C++ here and not more torch ops: on a CPU the decode step's attention is a few KB of work per
sequence spread over a paged cache, and the torch path pays for it in calls (one gather and one SDPA per
group of sequences per layer) and copies (each group's K/V gathered before it is read). One native call
per layer reads every sequence's K/V in place, block by block, with all threads (torch's own pool);
`loadtest.bench_kernels` and `loadtest.profile_engine` measure the difference.

The build: `g++` (or `$CXX`) against the installed torch's headers and libraries, `-O3 -march=native`,
into `$LORAGATE_KERNEL_CACHE` (default `~/.cache/loragate/kernels`), one directory per hash of the
sources and headers, the flags, the torch version and this CPU's model and flags, so machines sharing a
home directory never load each other's code. Processes starting together build once (a lock file); the
build goes to a private temporary file renamed into place. Sources compile in parallel (~15-25 s here).
Where no compiler works the library is absent: `available()` is False, a warning says why (once), and the
kernels fall back to the torch paths, which compute the same thing.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    _CSRC / name
    for name in (
        "paged_decode_cpu.cpp",
        "sgmv_cpu.cpp",
        "sgmv_group_cpu.cpp",
        "sgmv_group_shrink_cpu.cpp",
        "glue_cpu.cpp",
        "lm_head_cpu.cpp",
        "linear_amx.cpp",
        "decoder_cpu.cpp",
        "prefill_tiles_cpu.cpp",
    )
)
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
CACHE_ENV = "LORAGATE_KERNEL_CACHE"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w")


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "loragate" / "kernels"


def _cpu_identity() -> str:
    """This CPU's model and feature flags (what `-march=native` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in text.splitlines() if line.split(":")[0].strip() in keys}))


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths())]


def _link_flags() -> list[str]:
    from torch.utils import cpp_extension

    paths = cpp_extension.library_paths()
    return [*(f"-L{p}" for p in paths), *(f"-Wl,-rpath,{p}" for p in paths), "-lc10", "-ltorch_cpu"]


def _compile(compiler: str, output: Path) -> None:
    """Each source to an object in parallel (they are independent), then one link into `output`."""
    objects = [output.with_suffix(f".{i}.o") for i in range(len(SOURCES))]
    try:
        jobs = [
            subprocess.Popen(
                [compiler, *_flags(), "-c", str(src), "-o", str(obj)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src, obj in zip(SOURCES, objects, strict=True)
        ]
        errors = [job.communicate(timeout=600)[1] for job in jobs]
        for job, err in zip(jobs, errors, strict=True):
            if job.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {err.strip()[-2000:]}")
        done = subprocess.run(
            [compiler, *FLAGS, *(str(o) for o in objects), "-o", str(output), *_link_flags()],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed to link: {done.stderr.strip()[-2000:]}")
    finally:
        for obj in objects:
            obj.unlink(missing_ok=True)


def library_path() -> Path:
    """Where this machine's build of the sources lives (whether or not it is built yet)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_identity().encode())
    return cache_root() / digest.hexdigest()[:16] / "loragate_cpu.so"


def build() -> Path:
    """Compile the sources unless this machine's build exists; its path. RuntimeError saying why not.
    Processes starting together build once: the others wait on the build directory's lock."""
    target = library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or $CXX) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # built by the process that held the lock
            return target
        log.info("building the native CPU kernels into %s (once per machine)", target.parent)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            _compile(compiler, Path(tmp))
            os.replace(tmp, target)  # atomic: a reader never sees a half-written library
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


@cache
def available() -> bool:
    """Whether the native ops are loaded (built first if need be); False, with a warning, if they cannot."""
    try:
        torch.ops.load_library(str(build()))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        log.warning("native CPU kernels unavailable, using the torch paths: %s", e)
        return False
    return True
