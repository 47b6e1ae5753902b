"""Overload on a real stack (real Redis, a real gateway process, a load worker process of known capacity:
2 sequences at once, 10 tokens each at 50 ms a token, so about 4 requests/s): a burst far over capacity
gets 429 at once with `Retry-After` for the excess, the admitted requests start within the wait bound,
a light tenant is still admitted next to a flooding one, and `/health` stays fast throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import Stack
from worker.modelzoo.make import ZooPaths

MODEL = "tiny-load"
BOUND_S = 1.5
ALICE = {"Authorization": "Bearer sk-test-alice"}
BOB = {"Authorization": "Bearer sk-test-bob"}
BODY = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 10, "stream": True}


@pytest.fixture
def overload_stack(zoo: ZooPaths, redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(
        zoo,
        redis_url,
        tmp_path,
        admission_wait_bound_s=BOUND_S,
        fair_admission_per_worker=2,  # the backlog waits in the gateway's fair queue, not on the worker
    )
    worker: subprocess.Popen[bytes] | None = None
    try:
        with (tmp_path / "load-0.log").open("ab") as log:
            worker = subprocess.Popen(
                [
                    *(sys.executable, "-m", "loadtest.load_worker", "--worker-id", "load-0"),
                    *("--model-name", MODEL, "--model-dir", str(zoo.base("tiny"))),
                    *("--interval-ms", "50", "--max-running", "2"),
                ],
                env={**stack.env, "REDIS_URL": redis_url},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed whole below
            )
        stack.start_gateway()
        stack.wait_ready(workers=1)
        yield stack
    finally:
        stack.stop()
        if worker is not None:  # started in a session of its own: its group id is its pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=15)


@dataclass
class Outcome:
    status: int
    seconds: float  # send → response head (refusals) or first token (admitted)
    headers: httpx.Headers
    body: dict[str, object] | None = None
    tokens: int = 0


async def one(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Outcome:
    started = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=BODY, headers=headers) as resp:
        if resp.status_code != 200:
            body = json.loads(await resp.aread())
            return Outcome(resp.status_code, time.monotonic() - started, resp.headers, body)
        outcome = Outcome(200, 0.0, resp.headers)
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                if outcome.tokens == 0:
                    outcome.seconds = time.monotonic() - started
                outcome.tokens += 1
        return outcome


async def probe_health(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """A new connection per probe, as a load balancer's health check makes."""
    while not stop.is_set():
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(f"{url}/health")).status_code == 200
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.05)


async def scenario(url: str) -> tuple[list[Outcome], Outcome, list[float]]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        # Warm-up within capacity: the gateway measures the drain rate from what finishes.
        warm = await asyncio.gather(*(one(client, url, ALICE) for _ in range(6)))
        assert [o.status for o in warm] == [200] * 6
        stop, health = asyncio.Event(), list[float]()
        prober = asyncio.create_task(probe_health(url, stop, health))
        # 40 at once from alice: 10 s of work for a fleet that drains about 4 per second.
        flood = [asyncio.create_task(one(client, url, ALICE)) for _ in range(40)]
        await asyncio.sleep(0.5)
        light = await one(client, url, BOB)  # bob's one request, amid alice's flood
        outcomes = await asyncio.gather(*flood)
        stop.set()
        await prober
        return outcomes, light, health


def test_a_burst_over_capacity_gets_429_at_once_and_the_admitted_start_within_the_bound(
    overload_stack: Stack,
) -> None:
    outcomes, light, health = asyncio.run(asyncio.wait_for(scenario(overload_stack.url), 120))
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    assert len(admitted) + len(refused) == len(outcomes), [o.status for o in outcomes]
    # About 2 running + BOUND_S × 4/s queued get in; without admission control all 40 would, the last
    # ones after ~10 s.
    assert 2 <= len(admitted) <= 15 and len(refused) >= 25, (len(admitted), overload_stack.logs())
    assert all(o.tokens == BODY["max_tokens"] for o in admitted)
    # Admitted: first token within the bound, plus a little for the gateway and the client, plus one turn
    # (0.5 s) taken by bob, who came later and went first (that is what fair queueing is for).
    assert max(o.seconds for o in admitted) < BOUND_S + 0.5 + 0.3, sorted(o.seconds for o in admitted)
    for o in refused:
        assert o.seconds < 1.0  # refused at once, not after waiting
        assert o.body is not None and o.body["error"] == {
            "message": o.body["error"]["message"],  # type: ignore[index]
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_wait_exceeded",
        }
        estimate = float(o.headers["x-loragate-estimated-wait-s"])
        assert estimate > BOUND_S
        retry = int(o.headers["retry-after"])  # the excess wait, in whole seconds
        assert retry >= 1 and retry - 1 <= estimate - BOUND_S <= retry + 0.01
    # The light tenant waits behind at most one of alice's requests per turn: admitted, and soon served.
    assert light.status == 200 and light.seconds < BOUND_S + 0.3, (light.status, light.body)
    print(len(admitted), sorted(round(o.seconds, 2) for o in admitted), light.seconds, sorted(health)[-3:])
    assert len(health) >= 10
    assert sorted(health)[int(len(health) * 0.9)] < 0.1, sorted(health)
