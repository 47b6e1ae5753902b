"""Probe a gateway's `/health` from a process of its own, as a load balancer would, so that the load
generator's own busy event loop is not counted as the gateway's latency (`loadtest.overload`,
`tests/e2e/test_overload.py`). Each probe opens a new connection, sends `GET /health` and reads the whole
response; a probe that fails or takes longer than `--timeout-s` counts as a failure. Runs until stdin
closes (or `--duration-s`), then prints one JSON line: `latencies_ms` (of the probes that answered 200)
and `failures`. `HealthProbe` runs one from Python.

    python -m loadtest.health_probe --url http://127.0.0.1:8000 [--interval-ms 50] [--duration-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass


def probe(host: str, port: int, timeout_s: float) -> float | None:
    """Seconds for one `GET /health` on a new connection; None unless it answered 200 in time."""
    started = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
    except OSError:
        return None
    return time.perf_counter() - started if reply.startswith(b"HTTP/1.1 200") else None


def stdin_closed(wait_s: float) -> bool:
    """Waits up to `wait_s` for stdin; True once it is at end of file."""
    ready, _, _ = select.select([sys.stdin], [], [], wait_s)
    return bool(ready) and not os.read(sys.stdin.fileno(), 4096)


@dataclass
class ProbeResult:
    latencies_ms: list[float]
    failures: int


class HealthProbe:
    """A probe process for the duration of a `with` block; `result` is set when the block ends."""

    def __init__(self, url: str, interval_ms: float = 50.0):
        self.args = [sys.executable, "-m", "loadtest.health_probe", "--url", url]
        self.args += ["--interval-ms", str(interval_ms)]
        self.result = ProbeResult([], 0)

    def __enter__(self) -> HealthProbe:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            out, _ = self.proc.communicate(timeout=30)  # closes its stdin: it stops after this probe
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise
        raw = json.loads(out.decode().strip().splitlines()[-1])
        self.result = ProbeResult(raw["latencies_ms"], raw["failures"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.health_probe", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the gateway, http://host:port")
    p.add_argument(
        "--interval-ms", type=float, default=50.0, help="between the end of one probe and the next"
    )
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--duration-s", type=float, default=600.0, help="stop after this long at the latest")
    args = p.parse_args(argv)
    host, port = args.url.removeprefix("http://").rsplit(":", 1)
    latencies: list[float] = []
    failures = 0
    deadline = time.monotonic() + args.duration_s
    while time.monotonic() < deadline:
        took = probe(host, int(port), args.timeout_s)
        if took is None:
            failures += 1
        else:
            latencies.append(round(took * 1000, 3))
        if stdin_closed(args.interval_ms / 1000):
            break
    print(json.dumps({"latencies_ms": latencies, "failures": failures}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
