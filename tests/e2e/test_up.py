"""`loragate up`, the README's main-job command: it starts a working stack, prints a usable key, and
Ctrl-C stops everything (a second Ctrl-C kills at once), leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.stack import free_port
from worker.modelzoo.make import ZooPaths


def descendants(pid: int) -> set[int]:
    """Live processes below `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


@pytest.fixture
def up(zoo: ZooPaths) -> Iterator[tuple[subprocess.Popen[str], str, str, list[str]]]:
    """A running `loragate up` with one worker: (process, base URL, API key, its output so far)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # its own embedded Redis
    env["PYTHONUNBUFFERED"] = "1"
    args = [sys.executable, "-m", "loragate.cli", "up", "--port", str(port), "--workers", "1"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    key, seen = None, []
    deadline = time.monotonic() + 180
    while key is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if match := re.search(r"API key \(tenant \"dev\"\): (\S+)", line):
            key = match.group(1)
    stdout = proc.stdout

    def read_on() -> None:  # keeps the pipe from filling up, and the output for the test
        for line in stdout:
            seen.append(line)

    drain = threading.Thread(target=read_on, daemon=True)
    drain.start()
    try:
        assert key is not None, "".join(seen)
        yield proc, f"http://127.0.0.1:{port}", key, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        drain.join(10)  # EOF once every process holding the pipe is gone
        proc.stdout.close()


def test_up_serves_and_ctrl_c_stops_every_process(
    up: tuple[subprocess.Popen[str], str, str, list[str]],
) -> None:
    proc, url, key, _ = up
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
    done = client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 4
    children = descendants(proc.pid)
    assert len(children) >= 2  # the gateway and the worker (and the embedded redis-server)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert not alive(children)


def test_a_second_ctrl_c_kills_at_once(up: tuple[subprocess.Popen[str], str, str, list[str]]) -> None:
    proc, url, key, output = up
    body = {"model": "tiny", "prompt": "while True:", "max_tokens": 1500, "ignore_eos": True, "stream": True}

    def long_stream() -> None:  # keeps the worker draining when the stack is asked to stop
        try:
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            ) as resp:
                for _ in resp.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    threading.Thread(target=long_stream, daemon=True).start()
    time.sleep(1.0)
    children = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    proc.wait(timeout=30)
    assert time.monotonic() - started < 10
    assert not alive(children)
    time.sleep(0.2)
    assert "killing…" in "".join(output) and "Traceback" not in "".join(output)
