"""`loadtest.bench_serve` end to end on a small workload: the offline engine and a real stack (embedded
Redis, gateway and worker processes, real HTTP streams) serve the same requests, every key issue 15 reads is
there, every request streamed all its tokens; and the stack's processes are gone once it stops, also when
the benchmark is interrupted."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import bench_serve
from loadtest.serve_stack import ServeStack
from worker.modelzoo.make import ZooPaths

LEVEL_KEYS = (
    "serve_tok_s", "offline_tok_s", "serve_vs_offline", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
    "itl_p99_ms", "errors", "requests",
)  # fmt: skip


@pytest.mark.timeout(240)
def test_bench_serve_reports_every_level(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "6", "--adapters", "2", "--max-tokens", "12", "--concurrency", "2,3"]
    # The served worker on one thread, its step writes overlapping its steps (a core left to them).
    argv += ["--worker-flags", "--threads 1 --overlap-writes on"]
    assert bench_serve.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["model"], result["requests"]) == ("tiny", 6)
    assert result["output_tokens"] <= 6 * 12 and result["adapter_requests"] > 0
    assert result["offline_tok_s"] > 0
    assert set(result["concurrency"]) == {"2", "3"}
    for level in result["concurrency"].values():
        assert set(LEVEL_KEYS) <= set(level)
        assert (level["errors"], level["requests"]) == (0, 6), level["error_kinds"]
        assert level["output_tokens"] == result["output_tokens"]  # each request: exactly its max_tokens
        assert level["offline_tok_s"] > 0  # the engine with the level's number of requests in flight
        assert level["serve_tok_s"] > 0 and level["serve_vs_offline"] > 0
        assert level["serve_vs_offline"] == pytest.approx(
            level["serve_tok_s"] / level["offline_tok_s"], rel=0.02
        )
        assert level["serve_vs_offline_all_at_once"] == pytest.approx(
            level["serve_tok_s"] / result["offline_tok_s"], rel=0.02
        )
        assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"]
        assert 0 < level["itl_p50_ms"] <= level["itl_p99_ms"]
        for side in ("ttft", "offline_ttft"):  # the first wave (sent at once) apart from the rest
            assert 0 < level[f"{side}_first_wave_p50_ms"] <= level[f"{side}_first_wave_max_ms"]
            assert 0 < level[f"{side}_rest_p50_ms"] <= level[f"{side}_rest_p99_ms"]
        assert 0 < level["offline_ttft_p50_ms"] <= level["offline_ttft_p99_ms"]


def _stat(pid: int) -> tuple[int, str, int, int] | None:
    """(pid, state, parent, process group) from /proc, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return pid, fields[0], int(fields[1]), int(fields[2])


def _live_in_group(pgid: int) -> list[int]:
    """Processes of process group `pgid` still running (zombies left to an init that reaps late excluded)."""
    stats = [_stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [s[0] for s in stats if s is not None and s[3] == pgid and s[1] != "Z"]


@pytest.mark.timeout(180)
def test_stack_stops_every_process_group(zoo: ZooPaths, tmp_path: Path) -> None:
    adapters = {"renamed": zoo.adapter("tiny", zoo.adapter_names("tiny")[0])}
    with ServeStack(tmp_path, zoo.base("tiny"), "tiny", adapters, ["--kv-cache-mb", "32"]) as stack:
        stack.wait_ready()
        assert stack.redis.proc is not None
        pids = [p.pid for p in stack.procs.values()] + [stack.redis.proc.pid]
        assert (tmp_path / "adapters" / "renamed" / "adapter_config.json").exists()
    assert not [p for pid in pids for p in _live_in_group(pid)]


@pytest.mark.timeout(180)
def test_sigterm_stops_the_stack(tmp_path: Path) -> None:
    """SIGTERM while the stack runs: the benchmark exits and takes its children (their sessions) along."""
    argv = [sys.executable, "-m", "loadtest.bench_serve", "--requests", "2", "--max-tokens", "4"]
    argv += ["--adapters", "1", "--concurrency", "1"]
    log = tmp_path / "stderr.log"
    with log.open("wb") as err:  # a file, not a pipe nobody reads while the benchmark runs
        bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 150
        while len(stack := _stack_children(bench.pid)) < 3:  # Redis, the gateway, the worker
            assert bench.poll() is None and time.monotonic() < deadline, f"the stack did not start: {stack}"
            time.sleep(0.2)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text(errors="replace")[-2000:]
        assert not [p for pid in stack for p in _live_in_group(pid)]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _stack_children(pid: int) -> list[int]:
    """`pid`'s children that are the stack's: redis-server and `loragate.cli` processes."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = _stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is None or stat[2] != pid:
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if b"redis-server" in cmdline or b"loragate.cli" in cmdline:
                found.append(stat[0])
    return found
