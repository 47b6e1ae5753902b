"""`loragate up`, the README's main-job command, as real processes: it starts a working stack and prints a
usable key; SIGINT, SIGTERM or SIGHUP stops every process it started (a second signal kills at once);
its children die with it even when it is SIGKILLed; a crashed embedded Redis is restarted with its data;
two instances on one machine share nothing; a taken port is refused before anything starts.

Every `up` here is started with SIGINT ignored, as a service manager or a shell's background job starts
it (and as scripts/test runs the suite): it must not rely on Python's KeyboardInterrupt. Output is read
by a thread, so every wait has a deadline; teardown kills `up`'s process group and every descendant.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from loragate.paths import cache_dir
from loragate.rundir import remove_stale
from tests.e2e.proctools import Output, alive, command_lines, descendants
from tests.e2e.stack import free_port
from worker.modelzoo.make import ZooPaths


@dataclass
class Up:
    proc: subprocess.Popen[str]
    output: Output
    url: str
    key: str
    admin: str
    state: Path

    def complete(self) -> None:
        with openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, timeout=30, max_retries=0) as client:
            done = client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=4, temperature=0)
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        assert done.usage.completion_tokens == 4

    def worker_ids(self) -> list[str]:
        headers = {"Authorization": f"Bearer {self.admin}"}
        resp = httpx.get(f"{self.url}/admin/workers", headers=headers, timeout=10)
        return sorted(w["worker_id"] for w in resp.json()["workers"])


def _up_command(port: int) -> list[str]:
    return [sys.executable, "-m", "loragate.cli", "up", "--port", str(port), "--workers", "1"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # its own embedded Redis
    return env | {"PYTHONUNBUFFERED": "1"}


def _kill_everything(proc: subprocess.Popen[str], pids: set[int]) -> None:
    """SIGKILL `up`'s process group and each descendant's (the children run in sessions of their own)."""
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a group leader (each child leads its own session)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)  # or not one
    proc.wait(timeout=10)


@pytest.fixture
def start_up(zoo: ZooPaths) -> Iterator[Callable[[], Up]]:
    """Starts `loragate up` (one worker, a free port, SIGINT ignored) and waits for its banner."""
    started: list[tuple[subprocess.Popen[str], Output, set[int]]] = []

    def start() -> Up:
        port = free_port()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by `up`
        try:
            proc = subprocess.Popen(
                _up_command(port),
                env=_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        finally:
            signal.signal(signal.SIGINT, previous)
        assert proc.stdout is not None
        output = Output(proc.stdout)
        known: set[int] = set()
        started.append((proc, output, known))
        state = output.wait_for(r"state:\s+(\S+)", 240)
        assert state is not None, output.text()
        known |= descendants(proc.pid)
        key = output.wait_for(r"API key \(tenant \"dev\"\): (\S+)", 1)
        admin = output.wait_for(r"admin token:\s+(\S+)", 1)
        assert key is not None and admin is not None, output.text()
        url = f"http://127.0.0.1:{port}"
        return Up(proc, output, url, key.group(1), admin.group(1), Path(state.group(1)))

    yield start
    for proc, output, known in started:
        if proc.poll() is None:  # let it clean up its run directory, then make sure nothing survives
            known |= descendants(proc.pid)
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        _kill_everything(proc, known)
        output.wait_closed(10)
        assert proc.stdout is not None
        proc.stdout.close()
    remove_stale(cache_dir() / "up")  # what a SIGKILLed `up` left


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_up_serves_and_a_stop_signal_stops_every_process(
    start_up: Callable[[], Up], sig: signal.Signals
) -> None:
    up = start_up()
    up.complete()
    children = descendants(up.proc.pid)
    names = command_lines(children)
    assert "redis-server" in names and " gateway " in names and " worker " in names, names
    assert up.state.is_dir() and up.state.is_relative_to(cache_dir() / "up")
    up.proc.send_signal(sig)
    assert up.proc.wait(timeout=60) == 0, up.output.text()
    assert not alive(children)
    assert not up.state.exists()  # its run directory goes with it
    assert up.output.wait_closed(10)
    assert "Traceback" not in up.output.text()


def test_a_second_stop_signal_kills_at_once(start_up: Callable[[], Up]) -> None:
    up = start_up()
    body = {"model": "tiny", "prompt": "while True:", "max_tokens": 1500, "ignore_eos": True, "stream": True}

    streaming = threading.Event()

    def long_stream() -> None:  # keeps the worker draining when the stack is asked to stop
        try:
            with httpx.stream(
                "POST",
                f"{up.url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {up.key}"},
                timeout=60,
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        streaming.set()
        except httpx.HTTPError:
            pass

    threading.Thread(target=long_stream, daemon=True).start()
    assert streaming.wait(60), up.output.text()  # the worker is generating: it has something to drain
    children = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGTERM)
    assert up.output.wait_for("stopping…", 10), up.output.text()
    up.proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    up.proc.wait(timeout=30)
    assert time.monotonic() - started < 10
    assert not alive(children)
    assert up.output.wait_for("killing…", 5) and "Traceback" not in up.output.text()


def test_children_die_with_up_even_when_it_is_sigkilled(start_up: Callable[[], Up]) -> None:
    up = start_up()
    children = descendants(up.proc.pid)
    assert len(children) >= 3, command_lines(children)  # gateway, worker, redis-server
    up.proc.kill()  # no handler runs: only the kernel's parent-death signal can stop the children
    up.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(children), command_lines(alive(children))
    assert up.output.wait_closed(10)  # nobody holds the output pipe any more


def test_up_restarts_its_redis_which_comes_back_with_its_data(start_up: Callable[[], Up]) -> None:
    up = start_up()
    client = redis.Redis(unix_socket_path=str(up.state / "redis" / "redis.sock"), socket_timeout=5)
    ids = [client.xadd("lg:test:survives", {"n": str(i)}) for i in range(10)]
    client.close()
    time.sleep(1.5)  # one fsync of the append-only file later
    children = {pid: command_lines({pid}) for pid in descendants(up.proc.pid)}
    (old,) = [pid for pid, cmd in children.items() if "redis-server" in cmd]
    # Redis alone is under test here: the worker is paused so that how it rides out the outage (its own
    # concern) cannot end the stack first.
    workers = [pid for pid, cmd in children.items() if " worker " in cmd]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        os.kill(old, signal.SIGKILL)  # a crash: no shutdown, no final fsync
        assert up.output.wait_for("redis-server exited; restarting it", 10), up.output.text()
        client = redis.Redis(unix_socket_path=str(up.state / "redis" / "redis.sock"), socket_timeout=5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                if client.ping():
                    break
            time.sleep(0.1)
        assert [entry_id for entry_id, _ in client.xrange("lg:test:survives")] == ids
        client.close()
        assert any("redis-server" in command_lines({pid}) for pid in descendants(up.proc.pid) - {old})
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_two_instances_serve_independently_and_stop_alone(start_up: Callable[[], Up]) -> None:
    a, b = start_up(), start_up()
    assert a.state != b.state
    ids_a, ids_b = a.worker_ids(), b.worker_ids()
    # Each gateway sees only its own worker: separate Redis servers, distinct worker ids.
    assert len(ids_a) == 1 and len(ids_b) == 1 and ids_a != ids_b, (ids_a, ids_b)
    assert ids_a[0].endswith(a.state.name.split("-")[1]) and ids_b[0].endswith(b.state.name.split("-")[1])
    a.complete()
    b.complete()
    children_a = descendants(a.proc.pid)
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0, a.output.text()
    assert not alive(children_a) and not a.state.exists()
    b.complete()  # its Redis, gateway and worker untouched
    assert b.worker_ids() == ids_b and b.state.is_dir()
    assert httpx.get(f"{b.url}/health", timeout=5).json()["workers"] == 1


def test_a_taken_port_is_refused_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            _up_command(port),
            env=_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            start_new_session=True,
        )
    assert run.returncode == 2, run.stderr
    assert f"port {port} on 127.0.0.1 is not available" in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == ""  # nothing started: not even the model build, which prints the zoo's path
    assert not list((cache_dir() / "up").glob(f"{port}-*"))
