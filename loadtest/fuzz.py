"""`python -m loadtest.fuzz --cases 10000`: fuzz a live gateway and print one JSON line of results.

Against `--base-url` (with `--api-key` and `--admin-token`), or, without one, against a stack it starts:
an embedded Redis, one `tiny` worker and a gateway, as `loragate` processes. Three sources of cases share
the budget: schemathesis over the gateway's OpenAPI document (positive and negative, loadtest/fuzz_api.py),
its stateful runs along the document's links, and Hypothesis-made raw requests on a socket
(loadtest/fuzz_raw.py). A failure is a 5xx other than a designed 503, a hang (no answer within
`--timeout`), or an error that is not the OpenAI error object (loadtest/fuzz_tally.py). The gateway's RSS
is read from /proc before and after (its pid: the one started here, `--gateway-pid`, or the local process
listening on the URL's port).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtest.fuzz_api import Target, live_models, stateful, stateless
from loadtest.fuzz_raw import raw
from loadtest.fuzz_tally import Tally
from loadtest.procs import Processes, free_port, rss_mb, wait_healthy
from loragate.embedded_redis import redis_url
from worker.modelzoo.make import ensure_zoo

SHARES = {"raw": 0.3, "schemathesis": 0.55, "stateful": 0.15}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-url", help="a live gateway (default: start a stack here)")
    p.add_argument("--api-key", help="an API key of the live gateway")
    p.add_argument("--admin-token", help="its admin token")
    p.add_argument("--gateway-pid", type=int, help="the live gateway's pid, for its RSS")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds without an answer that make a hang")
    return p


def fuzz(target: Target, cases: int, seed: int, tally: Tally) -> None:
    """`cases` cases split between the three sources (the stateful runs may end a few steps over)."""
    n_raw, n_api = int(cases * SHARES["raw"]), int(cases * SHARES["schemathesis"])
    raw(target, tally, n_raw, seed, live_models(target))
    stateless(target, tally, n_api, seed)
    stateful(target, tally, max(1, cases - n_raw - n_api), seed)


@contextlib.contextmanager
def local_stack(work: Path) -> Iterator[tuple[Target, int]]:
    """Redis, a `tiny` worker and a gateway; yields the target and the gateway's pid."""
    zoo = ensure_zoo()
    key, admin = f"sk-fuzz-{secrets.token_hex(8)}", secrets.token_hex(16)
    config = work / "gateway.json"
    config.write_text(
        json.dumps(
            {"api_keys": {key: "fuzz"}, "admin_token": admin, "adapter_roots": [str(zoo.root / "adapters")]}
        )
    )
    with redis_url(work / "redis") as url:
        env = {**os.environ, "REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
        with Processes(work, env) as procs:
            worker = ["--model", str(zoo.base("tiny")), "--model-name", "tiny", "--worker-id", "fuzz-w0"]
            procs.spawn(
                "worker",
                ["-m", "loragate.cli", "worker", *worker, "--adapters", str(zoo.root / "adapters" / "tiny")],
            )
            port = free_port()
            pid = procs.spawn(
                "gateway", ["-m", "loragate.cli", "gateway", "--port", str(port), "--config", str(config)]
            )
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, "tiny", procs)
            yield Target(base, key, admin), pid


def listener_pid(port: int) -> int | None:
    """The local process listening on `port` (IPv4), found through /proc."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
    return None


def measure(target: Target, pid: int | None, cases: int, seed: int) -> dict[str, Any]:
    tally = Tally()
    before = rss_mb(pid) if pid else None
    started = time.monotonic()
    with tqdm(total=cases, desc="fuzz", unit="case", file=sys.stderr, mininterval=1.0) as bar:
        tally.on_case = lambda: bar.update(1)
        fuzz(target, cases, seed, tally)
    time.sleep(1.0)  # let the last connections close
    after = rss_mb(pid) if pid else None
    for failure in tally.failures:
        print("FAIL", failure, file=sys.stderr)
    growth = round(after - before, 1) if before is not None and after is not None else None
    return {
        **tally.summary(),
        "rss_growth_mb": growth,
        "gateway_rss_mb": [None if v is None else round(v, 1) for v in (before, after)],
        "seconds": round(time.monotonic() - started, 1),
        "seed": seed,
        "ok": tally.ok,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_url:
        if not (args.api_key and args.admin_token):
            raise SystemExit("--base-url needs --api-key and --admin-token")
        target = Target(args.base_url.rstrip("/"), args.api_key, args.admin_token, args.timeout)
        pid = args.gateway_pid or listener_pid(int(args.base_url.rstrip("/").rsplit(":", 1)[1]))
        result = measure(target, pid, args.cases, args.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp, local_stack(Path(tmp)) as (target, pid):
            target = Target(target.base_url, target.api_key, target.admin_token, args.timeout)
            result = measure(target, pid, args.cases, args.seed)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
