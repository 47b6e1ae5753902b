"""Run directories of `loragate up` instances: each its own, locked while alive, removed on exit; one left
by a SIGKILLed instance is removed by the next, one still alive never is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loragate.rundir import LOCK, remove_stale, run_dir


def test_instances_get_separate_locked_directories_removed_on_exit(tmp_path: Path) -> None:
    with run_dir(tmp_path, 8000) as (a, path_a), run_dir(tmp_path, 8001) as (b, path_b):
        assert a != b and path_a != path_b
        assert path_a.name == f"8000-{a}" and path_b.name == f"8001-{b}"
        assert remove_stale(tmp_path) == []  # both alive: their locks are held
        assert path_a.is_dir() and path_b.is_dir()
    assert not path_a.exists() and not path_b.exists()


def test_a_directory_whose_instance_died_is_removed_by_the_next(tmp_path: Path) -> None:
    # A real process takes an instance directory and is SIGKILLed: its lock goes with it, the directory stays.
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom loragate.rundir import run_dir\n"
        "with run_dir(Path(sys.argv[1]), 9000) as (_, path):\n"
        "    (path / 'gateway.json').write_text('{}')\n    print(path, flush=True)\n    time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        dead = Path(proc.stdout.readline().strip())
        assert remove_stale(tmp_path) == []  # alive: kept
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert (dead / LOCK).is_file() and (dead / "gateway.json").is_file()
    unrelated = tmp_path / "not-a-run-dir"
    unrelated.mkdir()
    with run_dir(tmp_path, 9000) as (_, alive):
        assert not dead.exists() and alive.is_dir() and unrelated.is_dir()
