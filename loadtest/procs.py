"""Child processes and measurements of them, for the benchmarks that run a real stack (gateway, workers,
Redis): spawn and stop, wait for health, CPU seconds and RSS, percentiles."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np


class BenchError(RuntimeError):
    pass


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# -- processes ------------------------------------------------------------------------------------------
class Processes:
    """Child processes, logged to files, all stopped on exit (SIGTERM, then SIGKILL after a grace)."""

    def __init__(self, logs: Path, env: dict[str, str]):
        self.logs, self.env = logs, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> int:
        log = (self.logs / f"{name}.log").open("wb")
        env = {**self.env, **(extra_env or {})}
        self.procs[name] = subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=log)
        log.close()
        return self.procs[name].pid

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise BenchError(f"{name} exited ({proc.returncode}):\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, *names: str, grace_s: float = 15.0) -> None:
        chosen = [n for n in (names or tuple(self.procs)) if n in self.procs]
        for name in chosen:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in chosen:
            proc = self.procs.pop(name)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(base: str, model: str, procs: Processes, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        with contextlib.suppress(httpx.HTTPError):
            if model in httpx.get(f"{base}/health", timeout=2).json().get("models", []):
                return
        time.sleep(0.2)
    raise BenchError(f"the gateway at {base} did not report a worker for {model!r} in {timeout_s} s")


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def cpu_s(pid: int) -> float | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


# -- 1. added TTFT ------------------------------------------------------------------------------------


class CPUMeter:
    """CPU seconds that child processes (by pid) and this process (the client) use from now on."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.before = [cpu_s(p) or 0.0 for p in pids]
        self.client_before = time.process_time()

    def used(self) -> list[float]:
        return [(cpu_s(p) or 0.0) - b for p, b in zip(self.pids, self.before, strict=True)]

    def client_used(self) -> float:
        return time.process_time() - self.client_before


@dataclass
class Sampler:
    """Peak RSS of a process, sampled in a thread while a phase runs."""

    pid: int
    peak_mb: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid) or 0.0)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[Sampler]:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
