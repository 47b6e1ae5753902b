"""Several CPU workers on one machine split its cores (`loragate.cpu_share`), and `loragate up` tells its
workers their share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loragate.cpu_share import threads_per_worker, usable_cores
from loragate.stack_config import ModelSpec, StackConfig
from loragate.up import _worker_args

ROOT = Path(__file__).resolve().parents[2]


def test_threads_per_worker_splits_the_cores() -> None:
    assert [threads_per_worker(w, cores=16) for w in (1, 2, 3, 4, 16, 40)] == [16, 8, 5, 4, 1, 1]
    assert threads_per_worker(3, cores=2) == 1  # more workers than cores: one thread each, never 0
    with pytest.raises(ValueError, match="workers"):
        threads_per_worker(0)
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert threads_per_worker(1) == usable_cores()


def _threads(args: list[str]) -> str | None:
    return args[args.index("--threads") + 1] if "--threads" in args else None


def test_up_gives_each_cpu_worker_its_share(tmp_path: Path) -> None:
    cores = usable_cores()
    stack = StackConfig(
        models=(
            ModelSpec("smollm2", str(tmp_path), workers=2),  # device left to the worker: may be the CPU
            ModelSpec("tiny", str(tmp_path), workers=1, device="cpu"),
            ModelSpec("big", str(tmp_path), workers=2, device="cuda"),  # GPU workers keep their default
        ),
        auto=(),
    )
    args = _worker_args(stack, "x1")
    threads = {worker: _threads(a) for worker, a in args.items()}
    share = str(max(1, cores // 3))
    assert threads == {
        "smollm2-0-x1": share,
        "smollm2-1-x1": share,
        "tiny-2-x1": share,
        "big-3-x1": None,
        "big-4-x1": None,
    }
    alone = StackConfig(models=(ModelSpec("tiny", str(tmp_path), workers=1),), auto=())
    assert _threads(next(iter(_worker_args(alone, "x2").values()))) is None  # one worker: every core


def test_worker_refuses_a_thread_count_below_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loragate.cli", "worker", "--model", str(tmp_path), "--threads", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert proc.returncode == 2 and "--threads: must be >= 1" in proc.stderr
