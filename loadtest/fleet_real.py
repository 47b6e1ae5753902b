"""One routing profile's run of the fleet load test on a real stack (`loadtest.fleet`).

A fresh `loragate up`-style stack (embedded Redis, a gateway, `workers` workers of the `tiny` model, each
with its Prometheus metrics) per profile, so no profile inherits another's caches. The gateway's policy is
`fleet_policy(profile)`: the default policy's document with the baselines added and `profile` as its
default. The workload is replayed open-loop: each request is sent at its arrival time (streamed, token
ids as the prompt, greedy, exactly its output length), whatever the ones before it are doing. Recorded:
each request's TTFT, inter-token gaps, cached prompt tokens and worker; every `poll_s` each worker's
queue length (`/admin/workers`); at the end each worker's adapter loads and prefix-cache counters. A run
may hand its stack on afterwards (`then`): the outside tool (`run_tool`) runs on the last one.
"""

from __future__ import annotations

import asyncio
import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.fleet_guidellm import run_guidellm
from loadtest.serve_clients import StreamStats, http_request, stream_one
from loadtest.serve_stack import API_KEY, ServeStack
from loadtest.sim_workload import SimRequest
from policies.default_policy import DEFAULT_POLICY

ADMIN_TOKEN = "fleet-admin"
MODEL = "tiny"
_SAMPLE = re.compile(r"^(loragate_engine_\w+)\{([^}]*)\} ([0-9.e+-]+)$", re.MULTILINE)


def fleet_policy(profile: str) -> dict[str, Any]:
    """DEFAULT_POLICY with two single-signal baselines, `prefix-only` and `adapter-only`, and `profile` as
    the profile every request runs."""
    doc = copy.deepcopy(DEFAULT_POLICY)
    admission = [
        {"ref": r} for r in ("serves-model", "not-draining", "healthy", "tenant-allowed", "queue-bound")
    ]
    doc["profiles"] += [
        {"name": "prefix-only", "plugins": [*admission, {"ref": "prefix"}, {"ref": "max"}]},
        {"name": "adapter-only", "plugins": [*admission, {"ref": "adapter"}, {"ref": "max"}]},
    ]
    doc["default_profile"] = profile
    return doc


@dataclass
class RealRun:
    profile: str
    stats: list[StreamStats]
    wall_s: float
    queue_depth: list[tuple[float, list[int]]] = field(default_factory=list)  # (s, queue length per worker)
    counters: dict[str, float] = field(default_factory=dict)  # summed over workers
    kv_blocks: int = 0  # per worker
    max_loras: int = 0


def adapter_links(num_adapters: int, zoo_adapters: list[Path]) -> dict[str, Path]:
    """`num_adapters` adapter names (`lora-000`...) over the zoo's few checkpoints, reused in turn."""
    return {f"lora-{i:03d}": zoo_adapters[i % len(zoo_adapters)] for i in range(num_adapters)}


def body(request: SimRequest) -> dict[str, Any]:
    name = request.adapter.rpartition(":")[2] if request.adapter else None
    return {
        "model": f"{MODEL}:{name}" if name else MODEL,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _replay(
    port: int, requests: list[SimRequest], time_scale: float
) -> tuple[list[StreamStats], float]:
    start = time.perf_counter()

    async def one(request: SimRequest) -> StreamStats:
        await asyncio.sleep(max(0.0, start + request.arrival_s * time_scale - time.perf_counter()))
        return await stream_one(port, http_request(port, API_KEY, body(request)), request.output_tokens)

    stats = await asyncio.gather(*(one(r) for r in requests))
    return list(stats), time.perf_counter() - start


async def _poll_queues(url: str, poll_s: float, out: list[tuple[float, list[int]]]) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            try:
                workers = (await client.get(f"{url}/admin/workers", headers=headers)).json()["workers"]
                ordered = sorted(workers, key=lambda w: w["worker_id"])
                out.append((time.perf_counter() - start, [int(w["queue_len"]) for w in ordered]))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(poll_s)


def scrape(urls: list[str]) -> dict[str, float]:
    """The workers' engine counters (`scrape_text`), read from their metrics endpoints."""
    return scrape_text([httpx.get(url, timeout=10).text for url in urls])


def scrape_text(texts: list[str]) -> dict[str, float]:
    """Engine counters summed over the workers' Prometheus texts: `adapter_loads_{disk,host}`,
    `prefix_tokens_{hit,queried}`."""
    totals: dict[str, float] = {}
    for text in texts:
        for name, labels, value in _SAMPLE.findall(text):
            kind = re.search(r'(?:tier|kind)="(\w+)"', labels)
            if kind and name in (
                "loragate_engine_adapter_loads_total",
                "loragate_engine_prefix_tokens_total",
            ):
                key = f"{name.removeprefix('loragate_engine_').removesuffix('_total')}_{kind.group(1)}"
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def run_profile(
    profile: str,
    requests: list[SimRequest],
    work: Path,
    model_dir: Path,
    adapters: dict[str, Path],
    workers: int,
    worker_flags: list[str],
    time_scale: float = 1.0,
    poll_s: float = 0.25,
    then: Callable[[str], None] | None = None,
) -> RealRun:
    """`requests` replayed on a fresh stack with `profile`; `then(url)` on the same stack afterwards, before
    it stops (outside the run's figures and counters)."""
    work.mkdir(parents=True, exist_ok=True)
    with ServeStack(
        work, model_dir, MODEL, adapters, worker_flags, workers=workers, admin_token=ADMIN_TOKEN, metrics=True
    ) as stack:
        stack.wait_ready()
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        resp = httpx.put(f"{stack.url}/admin/policy", json=fleet_policy(profile), headers=headers, timeout=10)
        resp.raise_for_status()
        state = httpx.get(f"{stack.url}/admin/workers", headers=headers, timeout=10).json()["workers"][0]

        async def main() -> tuple[list[StreamStats], float, list[tuple[float, list[int]]]]:
            depth: list[tuple[float, list[int]]] = []
            poller = asyncio.create_task(_poll_queues(stack.url, poll_s, depth))
            try:
                stats, wall = await _replay(stack.port, requests, time_scale)
            finally:
                poller.cancel()
            return stats, wall, depth

        stats, wall, depth = asyncio.run(main())
        counters = scrape(stack.metrics_urls)
        if then is not None:
            then(stack.url)
    return RealRun(
        profile, stats, wall, depth, counters, int(state["kv_blocks_total"]), int(state["max_adapters"])
    )


def run_tool(
    url: str,
    profile: str,
    model_dir: Path,
    rate: float,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    out_dir: Path,
) -> dict[str, float]:
    """guidellm (`loadtest.fleet_guidellm`) at `rate` against the stack at `url`, its policy's default
    `profile` (put there first)."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    resp = httpx.put(f"{url}/admin/policy", json=fleet_policy(profile), headers=headers, timeout=10)
    resp.raise_for_status()
    return run_guidellm(url, API_KEY, MODEL, model_dir, rate, requests, prompt_tokens, output_tokens, out_dir)
