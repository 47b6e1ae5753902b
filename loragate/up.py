"""`loragate up`: a whole serving stack in one command, mirroring compose.yaml.

What it serves (a loragate.stack_config.StackConfig, from loragate.up_args; checked whole before anything
starts, exit 2 if not):
- by default, the real model `smollm2` (fetched by `loragate models pull smollm2` on first use) on
  `--workers` workers with its shipped adapters, plus one worker of the toy `tiny` model (built by
  `loragate models make`) as the cheap rung of `model: "auto"`;
- `--model DIR|smollm2`: one model of yours (any local Hugging Face Llama/Qwen2/Mistral checkpoint), with
  `--adapters DIR`, on `--workers` workers, and nothing else;
- `-c stack.yaml`: what the file says (models, keys, admin token, `auto` rungs, host and port); no other
  flag may be combined with it, so the file and the command line cannot disagree.
`--device`, `--dtype` and `--kv-cache-mb` (a stack file's `device:`, `dtype:`, `kv_cache_mb:`) go to
every worker of the model.

It fetches or builds the named models (child processes), starts a real Redis (embedded, with an
append-only file, unless `REDIS_URL` is set), one gateway and the workers as child processes, waits until
every worker has joined, makes the routing policy's `auto` alias route to the stack's rungs (admin API),
writes the endpoint for local tools (loragate.endpoint), and prints how to call it (loragate.up_banner).

Instances: each `up` keeps its state (gateway config, embedded Redis) in a run directory of its own
under `<cache>/up/` (loragate.rundir), removed when it stops, and names its workers `<model>-<i>-<id>`,
so several instances on one machine, on different ports, share nothing. A port already taken is refused
(exit 2) before anything starts.

Stopping: SIGINT (Ctrl-C), SIGTERM or SIGHUP, also when SIGINT was inherited as ignored, drains and
stops every child (workers finish running requests; Redis goes last); a second one kills them at once.
The children run in sessions of their own and die with `up` even if it is SIGKILLed (loragate.proc).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loragate.cpu_share import threads_per_worker
from loragate.embedded_redis import EmbeddedRedis
from loragate.endpoint import Endpoint, write_endpoint
from loragate.paths import cache_dir
from loragate.proc import StopRequests, spawn
from loragate.rundir import run_dir
from loragate.stack_config import (
    StackConfig,
    StackError,
    check_adapters,
    check_checkpoint,
    with_auto,
)
from loragate.stack_sources import is_named, prepare_commands
from loragate.up_args import build_parser, stack_from_args
from loragate.up_banner import banner

HEALTHY_WITHIN_S = 300.0
GRACE_S = 30.0  # how long workers may drain before they are killed


def port_problem(host: str, port: int) -> str | None:
    """Why the gateway could not listen on host:port, or None. Binds the way uvicorn does (SO_REUSEADDR),
    so a port that only has connections in TIME_WAIT counts as free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        return f"cannot resolve host {host}: {err.strerror}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            why = f"port {port} on {host} is not available ({err.strerror})"
            return f"{why}; choose another (--port, or port: in a stack file)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stack = stack_from_args(args)
    except StackError as err:
        print(f"loragate up: {err}", file=sys.stderr)
        return 2
    if problem := port_problem(stack.host, stack.port):
        print(f"loragate up: {problem}", file=sys.stderr)
        return 2
    with StopRequests() as stops, run_dir(cache_dir() / "up", stack.port) as (instance, state):
        try:
            return _run(stack, instance, state, stops)
        except RuntimeError as err:  # the embedded Redis did not start; the policy could not be set
            print(f"loragate up: {err}", file=sys.stderr)
            return 1


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "loragate.cli", *args]


def _healthy(url: str, want: int) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return int(json.load(resp).get("workers", 0)) >= want
    except (OSError, ValueError):
        return False


def _prepare(stack: StackConfig, env: dict[str, str], stops: StopRequests) -> bool:
    """Fetch or build the named models, one child at a time; False if one failed or a stop came."""
    for command in prepare_commands(m.source for m in stack.models):
        child = spawn(_cli(*command), env=env)
        while child.poll() is None and not stops.count:
            time.sleep(0.2)
        if child.poll() is None:
            _stop({" ".join(command): child}, stops)
            return False
        if child.returncode:
            print(
                f"loragate up: loragate {' '.join(command)} failed (exit {child.returncode})", file=sys.stderr
            )
            return False
    for m in stack.models:
        try:
            if is_named(m.source):
                check_checkpoint(m.checkpoint, m.source)
            check_adapters(m)
        except StackError as err:
            print(f"loragate up: after fetching it, {err}", file=sys.stderr)
            return False
    return True


def _worker_args(stack: StackConfig, instance: str) -> dict[str, list[str]]:
    """Each worker's id and `loragate worker` arguments; ids are unique across instances. Workers not
    placed on a GPU share the cores (`loragate.cpu_share`) when there are several."""
    out, n = {}, 0
    on_cpu = sum(m.workers for m in stack.models if not str(m.device or "").startswith("cuda"))
    for m in stack.models:
        args = ["--model", str(m.checkpoint), "--model-name", m.name]
        if m.adapters is not None:  # present: `_prepare` checked it
            args += ["--adapters", str(m.adapters)] + [a for p in m.pin for a in ("--pin", p)]
        placed = (("--device", m.device), ("--dtype", m.dtype), ("--kv-cache-mb", m.kv_cache_mb))
        args += [a for flag, v in placed if v for a in (flag, str(v))]
        if on_cpu > 1 and not str(m.device or "").startswith("cuda"):
            args += ["--threads", str(threads_per_worker(on_cpu))]
        for _ in range(m.workers):
            worker_id = f"{m.name}-{n}-{instance}"
            out[worker_id] = ["worker", *args, "--worker-id", worker_id]
            n += 1
    return out


def _admin(url: str, token: str, method: str = "GET", body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)
    except OSError as err:
        detail = err.read().decode(errors="replace") if hasattr(err, "read") else ""
        raise RuntimeError(f"{method} {url}: {err} {detail}".strip()) from None


def _set_auto(url: str, admin: str, rungs: Sequence[Any]) -> None:
    """Make the active policy's `auto` alias route to `rungs`, keeping the rest of the policy: a new version
    only if it differs (an external Redis may hold an operator's policy)."""
    active = _admin(f"{url}/admin/policy", admin)["document"]
    if active.get("aliases", {}).get("auto", {}).get("rungs") != list(rungs):
        note = "loragate%20up%3A%20the%20stack%27s%20auto%20rungs"
        _admin(f"{url}/admin/policy?note={note}", admin, "PUT", with_auto(active, list(rungs)))


def _reachable(host: str) -> str:
    """How a client on this machine reaches a server listening on `host` (any address: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _run(stack: StackConfig, instance: str, state: Path, stops: StopRequests) -> int:
    env = {k: v for k, v in os.environ.items() if k != "LORAGATE_ADMIN_TOKEN"}  # the config file's wins
    if not _prepare(stack, env, stops):
        return 0 if stops.count else 1
    keys = dict(stack.api_keys) or {f"sk-dev-{secrets.token_hex(8)}": "dev"}
    admin = stack.admin_token or os.environ.get("LORAGATE_ADMIN_TOKEN") or secrets.token_urlsafe(16)
    roots = [str(m.adapters) for m in stack.models if m.adapters is not None]
    config = state / "gateway.json"
    config.touch(mode=0o600)
    config.write_text(json.dumps({"api_keys": keys, "admin_token": admin, "adapter_roots": roots}))
    redis_server = None if env.get("REDIS_URL") else EmbeddedRedis(state / "redis")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        if redis_server is not None:
            redis_server.start()
            env["REDIS_URL"] = redis_server.url
        port = str(stack.port)
        procs["gateway"] = spawn(
            _cli("gateway", "--host", stack.host, "--port", port, "--config", str(config)), env=env
        )
        for worker_id, args in _worker_args(stack, instance).items():
            procs[worker_id] = spawn(_cli(*args), env=env)
        http = f"http://{_reachable(stack.host)}:{stack.port}"
        key, tenant = next(iter(keys.items()))

        def on_healthy() -> str:
            _set_auto(http, admin, stack.auto)
            write_endpoint(state, Endpoint(f"{http}/v1", key))
            return banner(http, stack, key, tenant, admin, state)

        return _supervise(http, on_healthy, procs, stack.workers, stops, redis_server)
    finally:
        _stop(procs, stops)
        if redis_server is not None:
            redis_server.stop()


def _supervise(
    url: str,
    on_healthy: Callable[[], str],
    procs: dict[str, subprocess.Popen[bytes]],
    workers: int,
    stops: StopRequests,
    redis_server: EmbeddedRedis | None,
) -> int:
    """Until a stop signal (0) or a child's exit (1): once healthy, run `on_healthy` and print the banner it
    returns; restart the embedded Redis if it dies (its append-only file brings the queues back, less at
    most the last second)."""
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
                print(on_healthy(), flush=True)
            elif time.monotonic() > healthy_by:
                print("loragate up: the stack did not become healthy", file=sys.stderr)
                return 1
        time.sleep(0.2)
    print("\nstopping… (Ctrl-C again to kill at once)", file=sys.stderr, flush=True)
    return 0


def _stop(procs: dict[str, subprocess.Popen[bytes]], stops: StopRequests, grace_s: float = GRACE_S) -> None:
    """SIGTERM every child and wait while they drain; another stop signal (or the grace running out)
    kills what is left at once, so no child outlives `loragate up`. The stop was asked by one signal
    (or by a child that exited: none); a second one that came before this started counts too."""
    asked = min(stops.count, 1)
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
