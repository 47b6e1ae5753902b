"""An engine's process keeps the large buffers it frees for the next step (`worker.host_memory`).

malloc's settings belong to a process: `loadtest.bench_host_memory` runs each case as a fresh engine in a
child, once as every engine runs (`kept`) and once with the opt-out (`default`: glibc's own settings), and
counts the page faults of prefill steps of 8,192 fresh tokens after one like it (the MLP activations alone
are 45 MB; the KV blocks written were touched by the first). With glibc's settings the step's large buffers
are unmapped when freed and fault back in page by page; kept, they reuse the last step's pages.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import pytest

from loadtest import bench_host_memory
from tests.children import outputs, started
from worker.host_memory import ENV, keep_freed_memory
from worker.modelzoo.make import ZooPaths

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[2]
POOL_MB = 256

# A second engine in a process whose first one set malloc up: its KV pool, written all through, goes back to
# the kernel when the engine is dropped (prints the resident MB before it, with it, and after it).
SECOND_ENGINE = f"""
import gc, sys
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kv_cache import bytes_per_block


def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


first = LLMEngine(sys.argv[1], EngineConfig(num_kv_blocks=64))
before = resident_mb()
block_mb = bytes_per_block(first.model_config, first.config.block_size, first.config.dtype) / 2**20
second = LLMEngine(sys.argv[1], EngineConfig(num_kv_blocks=int({POOL_MB} / block_mb)))
second.kv.k.fill_(1.0)
second.kv.v.fill_(1.0)
with_it = resident_mb()
del second
gc.collect()
print(before, with_it, resident_mb())
"""


@pytest.mark.skipif(not GLIBC, reason="malloc's settings are glibc's")
@pytest.mark.timeout(150)
def test_a_prefill_step_reuses_the_last_ones_pages(zoo: ZooPaths, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--tokens", "8192", "--decode-seqs", "16", "--rounds", "1", "--steps", "3"]
    assert bench_host_memory.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["default_prefill_faults"] > 20_000  # the control: 45 MB of activations alone are 11k pages
    # Kept, the buffers settle within a few steps (the heap finds room for each size): by the last step few
    # fault (0-3k on a quiet AMD host, once 9k in a loaded CI run) where glibc's defaults fault 60-70k.
    assert result["kept_prefill_faults_last"] < result["default_prefill_faults_last"] / 5
    for key in ("prefill_ms", "decode_ms", "decode_faults", "maxrss_mb"):
        assert result[f"kept_{key}"] >= 0 and result[f"default_{key}"] >= 0
    assert result["prefill_speedup"] > 0 and result["decode_speedup"] > 0


@pytest.mark.skipif(not GLIBC, reason="malloc's settings are glibc's")
@pytest.mark.timeout(90)
def test_a_dropped_engines_kv_pool_goes_back_to_the_kernel(zoo: ZooPaths) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with started([([sys.executable, "-c", SECOND_ENGINE, str(zoo.base("tiny"))], env)], ROOT) as children:
        ((out, err),) = outputs(children, timeout_s=80)
    assert children[0].returncode == 0, err
    before, with_it, after = (float(x) for x in out.split())
    assert with_it - before > 0.8 * POOL_MB  # the pool was resident
    assert after - before < 0.2 * POOL_MB


def test_opt_out_and_other_platforms_change_nothing() -> None:
    assert keep_freed_memory({ENV: "0"}) is False
    assert keep_freed_memory({ENV: "off"}) is False
    assert keep_freed_memory({}) is GLIBC
