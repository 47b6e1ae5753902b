"""Two gateways on one Redis behind a round-robin client (issue 16): the routing state that matters is in
Redis or rebuilt from it, so either gateway routes like the other — prefix affinity learned from the
workers' KV events, the same active policy version — and SIGKILLing one gateway mid-stream loses nothing:
its clients retry on the other with the same `X-Request-Id`, attach to their requests, and every request
completes token-exact, generated once."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import redis

from tests.e2e.stack import ADMIN_TOKEN, Stack
from tests.e2e.test_request_identity import (
    Result,
    body,
    complete,
    offline,
    output_events,
    references,
)
from worker.engine import LLMEngine

__all__ = ["offline"]  # the fixture

KEY = {"Authorization": "Bearer sk-test-alice"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SYSTEM = "".join(f"def shared_{i}(value):\n    return value + {i}\n\n" for i in range(30))


def ask(url: str, prompt: str) -> httpx.Response:
    req = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=req, headers=KEY, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def test_either_gateway_follows_the_prefix_the_other_placed(stack: Stack) -> None:
    stack.wait_idle()
    proc, other = stack.extra_gateway()
    try:
        urls = [stack.url, other]
        policy = [httpx.get(f"{u}/admin/policy", headers=ADMIN).json()["version"] for u in urls]
        assert policy[0] == policy[1]
        holder = ask(urls[0], SYSTEM + "# placed by the first gateway").headers["x-loragate-worker"]
        time.sleep(0.6)  # the holder's KV events reach both gateways' prefix indexes
        for i in range(6):  # round robin: the second gateway never routed this prefix itself
            resp = ask(urls[(i + 1) % 2], SYSTEM + f"# follow-up {i}")
            assert resp.headers["x-loragate-worker"] == holder
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.timeout(300)
def test_killing_one_gateway_mid_stream_loses_nothing(stack: Stack, offline: LLMEngine) -> None:
    # Long enough that the doomed gateway's streams are still running when it is killed (the workers
    # stream a short answer before the kill lands).
    n, max_tokens = 12, 160
    prompts = [f"# job {i}\ndef run_{i}(queue):\n" for i in range(n)]
    refs = references(offline, prompts, max_tokens)
    ids = [f"rr-{i}-{time.monotonic_ns()}" for i in range(n)]
    stack.wait_idle()
    proc, other = stack.extra_gateway()
    r = redis.Redis.from_url(stack.redis_url, socket_timeout=10)
    limits = httpx.Limits(max_keepalive_connections=0)

    async def main() -> tuple[list[Result], int]:
        async with (
            httpx.AsyncClient(base_url=stack.url, timeout=120, limits=limits) as survivor,
            httpx.AsyncClient(base_url=other, timeout=120, limits=limits) as doomed,
        ):
            clients = [survivor, doomed]
            retried = 0

            async def one(i: int) -> Result:
                nonlocal retried
                try:
                    return await complete(clients[i % 2], "alice", body(prompts[i], max_tokens), ids[i])
                except httpx.HTTPError:  # its gateway died: the same request, through the other one
                    retried += 1
                    return await complete(survivor, "alice", body(prompts[i], max_tokens), ids[i])

            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the doomed gateway's streams are under way
                if all(output_events(r, "alice", ids[i]) for i in range(1, n, 2)):
                    break
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            return list(await asyncio.gather(*tasks)), retried

    try:
        results, retried = asyncio.run(main())
        stack.wait_idle()
        assert retried > 0  # the kill cut streams short
        for i, res in enumerate(results):
            assert res.ok and res.finish == "length", (i, res)
            assert res.text == refs[i], i
            events = output_events(r, "alice", ids[i])
            assert [e.finish_reason for e in events if e.is_last] == ["length"]  # generated once
            assert sum(len(e.token_ids) for e in events) == max_tokens
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        r.close()
