"""A `loragate up`-style stack for `bench_serve` and `fleet`: an embedded Redis, a gateway and workers, child
processes started as `up` starts them (`python -m loragate.cli ...`, each in a session of its own, killed
by the kernel if this process dies), logged to files, stopped by process group (SIGTERM, then SIGKILL).

The worker serves the benchmark's adapters through `--adapters DIR`, which registers each subdirectory
under its name; the benchmark's adapter names are not directory names (a zoo adapter is reused under
several names), so DIR is a directory of symlinks `name -> checkpoint`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.procs import BenchError, free_port
from loragate.cpu_share import threads_per_worker
from loragate.embedded_redis import EmbeddedRedis
from loragate.proc import spawn

API_KEY = "sk-bench-serve"


class ServeStack:
    """Redis + gateway + `workers` workers of `model_name`, in `work`; a context manager that stops them
    all. With `admin_token` the gateway's admin API is on; with `metrics` each worker serves Prometheus
    metrics (`metrics_urls`)."""

    def __init__(
        self,
        work: Path,
        model_dir: Path,
        model_name: str,
        adapters: dict[str, Path],
        worker_flags: list[str],
        workers: int = 1,
        admin_token: str | None = None,
        metrics: bool = False,
    ):
        self.work, self.model_name = work, model_name
        self.redis = EmbeddedRedis(work / "redis")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        adapter_dir = work / "adapters"
        adapter_dir.mkdir(parents=True, exist_ok=True)
        for name, path in adapters.items():
            (adapter_dir / name).symlink_to(path.resolve(), target_is_directory=True)
        self.workers = workers
        self.metrics_urls: list[str] = []
        self.worker_args: dict[str, list[str]] = {}
        for k in range(workers):
            name = "worker" if k == 0 else f"worker-{k}"
            # Several workers on this machine's CPUs share its cores (`loragate.cpu_share`).
            extra = ["--threads", str(threads_per_worker(workers))] if workers > 1 else []
            if metrics:
                port = free_port()
                extra += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
                self.metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
            self.worker_args[name] = [
                "worker",
                *("--model", str(model_dir), "--model-name", model_name, "--worker-id", f"bench-serve-w{k}"),
                *(("--adapters", str(adapter_dir)) if adapters else ()),
                *worker_flags,
                *extra,
            ]
        self.gateway_config: dict[str, object] = {
            "api_keys": {API_KEY: "bench"},
            "adapter_roots": [str(adapter_dir)],
        }
        if admin_token:
            self.gateway_config["admin_token"] = admin_token

    def __enter__(self) -> ServeStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.redis.start()
        env = {**os.environ, "REDIS_URL": self.redis.url, "PYTHONUNBUFFERED": "1"}
        env.pop("LORAGATE_ADMIN_TOKEN", None)  # the config file's settings win, as under `up`
        config = self.work / "gateway.json"
        config.write_text(json.dumps(self.gateway_config))
        gateway = ["gateway", "--host", "127.0.0.1", "--port", str(self.port), "--config", str(config)]
        for name, args in (("gateway", gateway), *self.worker_args.items()):
            with (self.work / f"{name}.log").open("wb") as log:  # the child keeps its own descriptor
                self.procs[name] = spawn(
                    [sys.executable, "-m", "loragate.cli", *args], env=env, stdout=log, stderr=log
                )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the gateway reports a live worker of the model; a child that exits fails at once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise BenchError(f"{name} exited ({proc.returncode}):\n{self.tail(name)}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(f"{self.url}/health", timeout=2).json()
                if self.model_name in health.get("models", []) and health.get("workers", 0) >= self.workers:
                    return
            time.sleep(0.2)
        raise BenchError(f"no worker for {self.model_name!r} after {timeout_s} s:\n{self.logs()}")

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.work / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.tail(name)}" for name in ("gateway", *self.worker_args))

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM each child's process group (the worker drains: nothing runs by now), SIGKILL what is left
        after `grace_s`; Redis last, as `up` stops it."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        self.redis.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """`spawn` starts each child in a session of its own, so its pid is its process group's id."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
