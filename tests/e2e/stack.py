"""A real loragate stack for end-to-end tests: the session's Redis, worker and gateway processes.

Processes are started exactly as `loragate up` starts them (`python -m loragate.cli ...`), on loopback,
and can be SIGKILLed and restarted by the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis

from loragate.cpu_share import threads_per_worker
from worker.modelzoo.make import ZooPaths

API_KEYS = {"sk-test-alice": "alice", "sk-test-bob": "bob"}
ADMIN_TOKEN = "admin-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    def __init__(
        self, zoo: ZooPaths, redis_url: str, workdir: Path, *, worker_count: int = 2, **gateway_config: object
    ):
        self.zoo, self.redis_url, self.workdir = zoo, redis_url, workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.gateway: subprocess.Popen[bytes] | None = None
        self.config = workdir / "gateway.json"
        self.config.write_text(
            json.dumps(
                {
                    "api_keys": API_KEYS,
                    "admin_token": ADMIN_TOKEN,
                    "adapter_roots": [str(zoo.root / "adapters")],
                    **gateway_config,
                }
            )
        )
        self.env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
        # Each worker's share of the cores (`loragate up` gives its workers theirs), for `worker_count`
        # workers on this machine: with every core each, their OpenMP threads spin against each other and
        # every step is several times slower (12 greedy requests of 160 tokens on two tiny workers, two
        # cores: 17-25 s with every core each, 2-2.4 s with one each).
        self.worker_threads = threads_per_worker(worker_count)

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        if args[:1] == ["worker"] and "--threads" not in args:
            args = [*args, "--threads", str(self.worker_threads)]
        with (self.workdir / log).open("ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen(
                [sys.executable, "-m", "loragate.cli", *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def start_worker(self, worker_id: str, base: str = "tiny", metrics_port: int | None = None) -> None:
        extra = ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"] if metrics_port else []
        self.workers[worker_id] = self._spawn(
            [
                "worker",
                "--model",
                str(self.zoo.base(base)),
                "--model-name",
                base,
                "--worker-id",
                worker_id,
                "--adapters",
                str(self.zoo.root / "adapters" / base),
                "--kv-cache-mb",
                "64",
                *extra,
            ],
            f"{worker_id}.log",
        )

    def start_gateway(self) -> None:
        self.gateway = self._spawn(
            ["gateway", "--port", str(self.port), "--config", str(self.config)], "gateway.log"
        )

    def extra_gateway(self, **config: object) -> tuple[subprocess.Popen[bytes], str]:
        """Another gateway process on the same Redis, with config overrides; returns (process, url)."""
        port = free_port()
        path = self.workdir / f"gateway-{port}.json"
        path.write_text(json.dumps({**json.loads(self.config.read_text()), **config}))
        proc = self._spawn(["gateway", "--port", str(port), "--config", str(path)], f"gateway-{port}.log")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        proc.kill()
        raise TimeoutError(self.logs())

    def kill_worker(self, worker_id: str) -> None:
        proc = self.workers.pop(worker_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def kill_gateway(self) -> None:
        assert self.gateway is not None
        self.gateway.send_signal(signal.SIGKILL)
        self.gateway.wait()
        self.gateway = None

    def wait_ready(self, workers: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in [("gateway", self.gateway), *self.workers.items()]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {self.logs()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200 and r.json()["workers"] >= workers:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"stack not ready: {self.logs()}")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no worker has outstanding requests (earlier tests' work is done)."""
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        while time.monotonic() < deadline:
            workers = httpx.get(f"{self.url}/admin/workers", headers=headers, timeout=5).json()["workers"]
            if all(w["queue_len"] == 0 for w in workers):
                return
            time.sleep(0.2)
        raise TimeoutError("workers still busy")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.workdir.glob("*.log"))

    def stop(self) -> None:
        procs = [p for p in [self.gateway, *self.workers.values()] if p is not None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def flush_redis(redis_url: str) -> None:
    """Empty the test Redis (what an earlier module stored must not reach the next)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
    try:
        client.flushall()
    finally:
        client.close()


@contextlib.contextmanager
def running_stack(
    zoo: ZooPaths,
    redis_url: str,
    workdir: Path,
    workers: tuple[str, ...] = ("w1", "w2"),
    stack_type: type[Stack] = Stack,
    **gateway_config: object,
) -> Iterator[Stack]:
    """A stack on a freshly emptied Redis: `workers` (tiny) and a gateway, ready; stopped afterwards."""
    flush_redis(redis_url)
    s = stack_type(zoo, redis_url, workdir, worker_count=len(workers), **gateway_config)
    try:
        for worker_id in workers:
            s.start_worker(worker_id)
        s.start_gateway()
        s.wait_ready(workers=len(workers))
        yield s
    finally:
        s.stop()
