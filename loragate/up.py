"""`loragate up`: the whole dev stack in one command, mirroring compose.yaml.

Builds the demo models if missing, starts a real Redis (embedded, with an append-only file, unless
`REDIS_URL` is set), one gateway and N workers (alternating the `tiny` and `small` base models, each
registering its demo adapters) as child processes, waits until the gateway is healthy, and prints how to
call it.

Instances: each `up` keeps its state (gateway config, embedded Redis) in a run directory of its own
under `<cache>/up/` (loragate.rundir), removed when it stops, and names its workers `<base>-<i>-<id>`,
so several instances on one machine, on different ports, share nothing. A port already taken is refused
(exit 2) before anything starts.

Stopping: SIGINT (Ctrl-C), SIGTERM or SIGHUP, also when SIGINT was inherited as ignored, drains and
stops every child (workers finish running requests; Redis goes last); a second one kills them at once.
The children run in sessions of their own and die with `up` even if it is SIGKILLed (loragate.proc).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from loragate.embedded_redis import EmbeddedRedis
from loragate.paths import cache_dir
from loragate.proc import StopRequests, spawn
from loragate.rundir import run_dir

BASES = ("tiny", "small")
HEALTHY_WITHIN_S = 300.0
GRACE_S = 30.0  # how long workers may drain before they are killed


def port_problem(host: str, port: int) -> str | None:
    """Why the gateway could not listen on host:port, or None. Binds the way uvicorn does (SO_REUSEADDR),
    so a port that only has connections in TIME_WAIT counts as free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        return f"cannot resolve --host {host}: {err.strerror}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            return f"port {port} on {host} is not available ({err.strerror}); choose another with --port"
    return None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "loragate.cli", *args]


def _healthy(url: str, want: int) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return int(json.load(resp).get("workers", 0)) >= want
    except (OSError, ValueError):
        return False


def _banner(url: str, key: str, admin: str, model: str, adapter: str, state: Path) -> str:
    return f"""
loragate is up at {url}  (OpenAI-compatible)
  API key (tenant "dev"): {key}
  admin token:           {admin}

  curl {url}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{adapter}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key}'); \\
print(c.completions.create(model='{model}', prompt='def fib(n):', max_tokens=32).choices[0].text)"

  models: curl {url}/v1/models -H "Authorization: Bearer {key}"
  fleet:  curl {url}/admin/workers -H "Authorization: Bearer {admin}"
  state:  {state}  (removed on exit)
Ctrl-C stops everything.
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loragate up", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=2, help="worker processes (alternating tiny, small)")
    args = p.parse_args(argv)
    if problem := port_problem(args.host, args.port):
        print(f"loragate up: {problem}", file=sys.stderr)
        return 2
    with StopRequests() as stops, run_dir(cache_dir() / "up", args.port) as (instance, state):
        try:
            return _run(args, instance, state, stops)
        except RuntimeError as err:  # the embedded Redis did not start
            print(f"loragate up: {err}", file=sys.stderr)
            return 1


def _run(args: argparse.Namespace, instance: str, state: Path, stops: StopRequests) -> int:
    env = dict(os.environ)
    make = spawn(_cli("models", "make"), env=env)
    while make.poll() is None and not stops.count:
        time.sleep(0.2)
    if make.poll() is None:
        _stop({"models make": make}, stops)
        return 0
    if make.returncode:
        return 1
    zoo = cache_dir() / "zoo-v1"
    key, admin = f"sk-dev-{secrets.token_hex(8)}", secrets.token_urlsafe(16)
    config = state / "gateway.json"
    config.touch(mode=0o600)
    config.write_text(
        json.dumps({"api_keys": {key: "dev"}, "admin_token": admin, "adapter_roots": [str(zoo / "adapters")]})
    )
    redis_server = None if env.get("REDIS_URL") else EmbeddedRedis(state / "redis")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        if redis_server is not None:
            redis_server.start()
            env["REDIS_URL"] = redis_server.url
        procs["gateway"] = spawn(
            _cli("gateway", "--host", args.host, "--port", str(args.port), "--config", str(config)), env=env
        )
        for i in range(args.workers):
            base = BASES[i % len(BASES)]
            worker_id = f"{base}-{i}-{instance}"  # unique across instances: each consumes only its own queue
            model, adapters = str(zoo / base), str(zoo / "adapters" / base)
            worker = ["--model", model, "--model-name", base, "--adapters", adapters, "--worker-id"]
            procs[worker_id] = spawn(_cli("worker", *worker, worker_id), env=env)
        http = f"http://{args.host}:{args.port}"
        banner = _banner(http, key, admin, "tiny", "tiny:qv-r8", state)
        return _supervise(http, banner, procs, args.workers, stops, redis_server)
    finally:
        _stop(procs, stops)
        if redis_server is not None:
            redis_server.stop()


def _supervise(
    url: str,
    banner: str,
    procs: dict[str, subprocess.Popen[bytes]],
    workers: int,
    stops: StopRequests,
    redis_server: EmbeddedRedis | None,
) -> int:
    """Until a stop signal (0) or a child's exit (1): print the banner once healthy; restart the embedded
    Redis if it dies (its append-only file brings the queues back, less at most the last second)."""
    healthy, healthy_by = False, time.monotonic() + HEALTHY_WITHIN_S
    while not stops.count:
        if redis_server is not None and not redis_server.running():
            print("loragate up: redis-server exited; restarting it", file=sys.stderr, flush=True)
            redis_server.start()  # RuntimeError (with Redis's log) if it cannot: main reports it
        exited = [f"{name} (exit {p.returncode})" for name, p in procs.items() if p.poll() is not None]
        if exited:
            print(f"loragate up: {', '.join(exited)} stopped; stopping the stack", file=sys.stderr)
            return 1
        if not healthy:
            if _healthy(url, workers):
                healthy = True
                print(banner, flush=True)
            elif time.monotonic() > healthy_by:
                print("loragate up: the stack did not become healthy", file=sys.stderr)
                return 1
        time.sleep(0.2)
    print("\nstopping… (Ctrl-C again to kill at once)", file=sys.stderr, flush=True)
    return 0


def _stop(procs: dict[str, subprocess.Popen[bytes]], stops: StopRequests, grace_s: float = GRACE_S) -> None:
    """SIGTERM every child and wait while they drain; another stop signal (or the grace running out)
    kills what is left at once, so no child outlives `loragate up`."""
    asked = stops.count
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs.values()):
        if stops.count > asked:
            print("killing…", file=sys.stderr, flush=True)
            break
        if time.monotonic() > deadline:
            print(f"loragate up: still running after {grace_s:.0f} s; killing", file=sys.stderr, flush=True)
            break
        time.sleep(0.1)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
