"""vLLM's OpenAI server beside loragate's stack in `bench_serve --vllm-python`: the same model, adapters,
warm-up and streaming clients (`loadtest.serve_clients`), so TTFT and throughput compare in one run.

The server is `python -m vllm.entrypoints.openai.api_server` in vLLM's own interpreter, with the CPU
setup of `loadtest.bench_vllm.vllm_env` (OpenMP bound to this process's cores, Intel OpenMP and tcmalloc
preloaded where present), LoRA enabled with every adapter on the device at once, each adapter served
under the name loragate gives it (`model:adapter`, as `serve_clients` asks for it). It runs in a session
of its own (vLLM starts processes of its own), stopped by process group: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from loadtest.bench_vllm import DEFAULT_KV_GB, vllm_env
from loadtest.procs import BenchError, free_port
from loadtest.serve_clients import StreamStats, run_clients, summarize
from loragate.proc import spawn
from loragate.types import Request


class VLLMServer:
    """vLLM serving `model_dir` as `model` with `adapters` on a free port; a context manager."""

    def __init__(
        self, python: str, model_dir: Path, model: str, adapters: dict[str, Path], dtype: str, log: Path
    ):
        self.port = free_port()
        ranks = [json.loads((p / "adapter_config.json").read_text())["r"] for p in adapters.values()]
        lora = (
            [
                *("--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(max(ranks))),
                "--lora-modules",
                *(f"{model}:{name}={path}" for name, path in adapters.items()),
            ]
            if adapters
            else []
        )
        args = [
            *(python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
            *("--served-model-name", model, "--port", str(self.port), "--host", "127.0.0.1"),
            *("--dtype", dtype, "--seed", "0", *lora),
        ]
        self.log = log
        with log.open("wb") as f:
            env = {**os.environ, **vllm_env(python, DEFAULT_KV_GB)}
            self.proc = spawn(args, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"vLLM's server exited ({self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise BenchError(f"vLLM's server was not ready in {timeout_s} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever vLLM started and left behind


def served_vllm(
    python: str,
    model_dir: Path,
    model: str,
    adapters: dict[str, Path],
    dtype: str,
    warm: list[Request],
    requests: list[Request],
    concurrency: int,
    log: Path,
) -> tuple[list[StreamStats], float]:
    """The warm-up, then the workload, through a fresh vLLM server by `concurrency` streaming clients."""
    with VLLMServer(python, model_dir, model, adapters, dtype, log) as server:
        server.wait_ready()
        warmed, _ = asyncio.run(run_clients(server.port, "none", model, warm, concurrency, "vLLM warm-up"))
        if failed := [w.error for w in warmed if w.error is not None]:
            raise BenchError(f"vLLM warm-up requests failed ({failed[:3]}):\n{server.tail()}")
        label = f"vLLM served, {concurrency} clients"
        return asyncio.run(run_clients(server.port, "none", model, requests, concurrency, label))


def vllm_figures(results: list[StreamStats], wall_s: float) -> dict[str, Any]:
    """A vLLM level's figures, under the names loragate's have (`serve_clients.summarize`)."""
    keys = ("serve_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "errors", "wall_s")
    figures = summarize(results, wall_s)
    return {key: figures[key] for key in keys}
