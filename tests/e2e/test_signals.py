"""The gateway and the worker stop on SIGINT, SIGTERM and SIGHUP through their own shutdown paths, also
when started with SIGINT ignored (as by a service manager or a shell's background job).

Exit status 0 proves a handler ran and the process returned from main: before, SIGHUP killed both
outright (status -1) and uvicorn ended a SIGTERMed gateway by raising the signal again (status -15).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis

from loragate import contracts
from tests.e2e.stack import free_port
from worker.modelzoo.make import ZooPaths


def _start_with_sigint_ignored(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child, as from a shell's `&`
    try:
        with log.open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "loragate.cli", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
    finally:
        signal.signal(signal.SIGINT, previous)


def _until(
    ready: Callable[[], bool], timeout: float, procs: list[subprocess.Popen[bytes]], logs: Path
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), _logs(logs)
        if ready():
            return
        time.sleep(0.2)
    pytest.fail(f"not ready after {timeout} s:\n{_logs(logs)}")


def _logs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(workdir.glob("*.log")))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_gateway_and_worker_stop_cleanly_on_every_stop_signal(
    sig: signal.Signals, zoo: ZooPaths, redis_url: str, tmp_path: Path
) -> None:
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"api_keys": {"sk-sig": "t"}}))
    port, worker_id = free_port(), f"sig-{sig.name.lower()}"
    gateway = _start_with_sigint_ignored(
        ["gateway", "--port", str(port), "--config", str(config)], env, tmp_path / "gateway.log"
    )
    worker_args = ["--model", str(zoo.base("tiny")), "--model-name", "tiny", "--kv-cache-mb", "32"]
    worker = _start_with_sigint_ignored(
        ["worker", *worker_args, "--worker-id", worker_id], env, tmp_path / "worker.log"
    )
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    procs = [gateway, worker]
    try:

        def serving() -> bool:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return False
            return bool(client.exists(contracts.worker_state("tiny", worker_id))) and health["workers"] == 1

        _until(serving, 120, procs, tmp_path)
        for proc in procs:
            proc.send_signal(sig)
        for proc in procs:
            assert proc.wait(timeout=60) == 0, _logs(tmp_path)
        assert f"draining (signal {int(sig)})" in (tmp_path / "worker.log").read_text()
        assert "Traceback" not in _logs(tmp_path)
    finally:
        client.close()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
