"""Request identity on the real stack (real Redis, two `tiny` workers that run at most 4 sequences each,
so requests wait in Redis queues, a real gateway):

- an `X-Request-Id` belongs to the tenant of the key that sent it: another tenant sending the same id,
  before or after the owner, streaming or not, gets its own generation, and cannot read, stall or
  cancel the owner's;
- a retry with the same id attaches to the request already queued, running or finished, also after a
  SIGKILLed gateway: no second copy, no error, no garbled text;
- a request whose client left mid-generation and retried comes back complete (`length`), not cut short;
  and a handler whose request is cut short by another handler of the same id leaving continues it;
- a request still waiting in a queue when its client leaves is dropped before it runs.

Texts are compared token-exact with the engine's offline greedy output.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest
from loragate.types import Request, SamplingParams
from tests.e2e.offline import continued, one_thread, resume_cuts
from tests.e2e.stack import Stack, running_stack
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

KEYS = {"alice": "sk-test-alice", "bob": "sk-test-bob"}
MAX_NUM_SEQS = 4
# Tokens: still running when a second client of the same id comes and goes (which takes a fraction of a
# second; 300 tokens take ~2 s on a tiny worker, 600 did no more and cost ~2 s more in each of five tests).
LONG = 300
# The prompts generated LONG tokens long: their references are made in one batch (as cheap as one). Their
# greedy runs have no near-tie (the top two log-probabilities 1.7e-3 apart at least): a request continued
# after an abort is prefilled again, and a tie closer than fp32's rounding may go either way there (the
# prompt "class LRUCache:..." had one 2.9e-6 apart at token 108), see `continued_reference`.
LONG_PROMPTS = (
    "async def fetch_all(urls):\n",
    "def merge_sort(items):\n",
    "def binary_search(items, target):\n",
)
KILL_REQUESTS = int(os.environ.get("LORAGATE_E2E_KILL_REQUESTS", "32"))


class SmallBatchStack(Stack):
    """Workers that run at most `MAX_NUM_SEQS` sequences at once (and take 8 more into their engine):
    beyond that, requests wait in their Redis queues."""

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        if args and args[0] == "worker":
            args = [*args, "--max-num-seqs", str(MAX_NUM_SEQS)]
        return super()._spawn(args, log)


@pytest.fixture(scope="module")
def stack(zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Queue-wait admission (429) off, and the gateway's fair queue only past 64 outstanding per worker
    # (not at the worker's batch size, the default): these tests queue requests in Redis on purpose.
    workdir = Path(tmp_path_factory.mktemp("identity"))
    with running_stack(
        zoo,
        redis_server,
        workdir,
        stack_type=SmallBatchStack,
        admission_wait_bound_s=0,
        fair_admission_per_worker=64,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def offline(zoo: ZooPaths) -> LLMEngine:
    return LLMEngine(zoo.base("tiny"), EngineConfig())


@pytest.fixture
def r(stack: Stack) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=10)
    yield client
    client.close()


# (prompt, max_tokens) -> the offline greedy text: one checkpoint, greedy, so a text two tests (or a test's
# two parametrizations) compare against is generated once.
_REFERENCES: dict[tuple[str, int], str] = {}


def references(engine: LLMEngine, prompts: list[str], max_tokens: int) -> list[str]:
    """Offline greedy texts, those not generated before in one batch."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    missing = [p for p in dict.fromkeys(prompts) if (p, max_tokens) not in _REFERENCES]
    reqs = [
        Request(
            f"ref-{i}-{time.monotonic_ns()}",
            tuple(engine.tokenizer.encode(p, add_special_tokens=False).ids),
            params,
        )
        for i, p in enumerate(missing)
    ]
    if reqs:
        with one_thread():
            texts = [c.text for c in engine.generate(reqs)]
        _REFERENCES.update(((p, max_tokens), t) for p, t in zip(missing, texts, strict=True))
    return [_REFERENCES[p, max_tokens] for p in prompts]


def continued_reference(engine: LLMEngine, prompt: str, ref: str, text: str, cuts: list[int]) -> str:
    """`ref` when `text` is it, else the reference of the request as its workers continued it after
    `cuts` streamed tokens (prefilled again there: a near-tie may go the other way, `tests.e2e.offline`)."""
    if text == ref:
        return ref
    return continued(engine, prompt, SamplingParams(max_tokens=LONG, ignore_eos=True), cuts)


def body(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, object]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass
class Result:
    status: int
    text: str = ""
    finish: str | None = None
    error: str | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def headers(tenant: str, rid: str | None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {KEYS[tenant]}"}
    return h | {"X-Request-Id": rid} if rid else h


async def complete(
    client: httpx.AsyncClient, tenant: str, req: dict[str, object], rid: str | None = None
) -> Result:
    """One request, streamed or not, read to its end."""
    h = headers(tenant, rid)
    if not req["stream"]:
        resp = await client.post("/v1/completions", json=req, headers=h)
        if resp.status_code != 200:
            return Result(resp.status_code, error=resp.text)
        choice, usage = resp.json()["choices"][0], resp.json()["usage"]
        return Result(200, choice["text"], choice["finish_reason"], None, usage["completion_tokens"])
    result = Result(0)
    streamed = {**req, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=streamed, headers=h) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            result.error = (await resp.aread()).decode()
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = json.dumps(chunk["error"])
            elif chunk["choices"]:
                result.text += chunk["choices"][0]["text"]
                result.finish = chunk["choices"][0]["finish_reason"] or result.finish
            else:
                result.completion_tokens = chunk["usage"]["completion_tokens"]
    return result


async def read_then_leave(url: str, tenant: str, req: dict[str, object], rid: str, chunks: int) -> None:
    """Stream `chunks` chunks, then drop the connection (its own client, so the socket really closes)."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=req, headers=headers(tenant, rid)) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: {")
            if seen >= chunks:
                return


def client_for(stack: Stack, timeout: float = 240) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=stack.url, timeout=timeout, limits=limits)


def output_events(r: redis.Redis, tenant: str, rid: str) -> list[OutputEvent]:
    return [
        OutputEvent.from_json(f[b"e"])
        for _, f in r.xrange(contracts.output("tiny", contracts.scoped_request_id(tenant, rid)))
    ]


def wait_for_abort(r: redis.Redis, tenant: str, rid: str, timeout: float = 20.0) -> list[OutputEvent]:
    """Until the request's output stream ends with an abort (its client left and it was cancelled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = output_events(r, tenant, rid)
        if events and events[-1].finish_reason == "abort":
            return events
        time.sleep(0.05)
    raise AssertionError(f"{rid} was not cancelled within {timeout} s: {output_events(r, tenant, rid)}")


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@contextmanager
def frozen_workers(stack: Stack, r: redis.Redis) -> Iterator[None]:
    """Every worker stopped (SIGSTOP) yet counted live, as a worker in one long step is: the test keeps its
    heartbeat from expiring. What the gateway queues meanwhile waits unread; SIGCONT on leaving."""
    pids = [p.pid for p in stack.workers.values()]
    beats = [contracts.worker_state("tiny", w) for w in stack.workers]
    done = threading.Event()

    def keep_alive() -> None:
        while not done.wait(0.5):
            for key in beats:
                r.expire(key, contracts.HEARTBEAT_TTL_S)

    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    beating = threading.Thread(target=keep_alive, daemon=True)
    beating.start()
    try:
        # A read a worker had blocked in Redis could still take an entry (the server answers it into the
        # socket): let it time out first (BLOCK 100 ms).
        time.sleep(0.3)
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        done.set()
        beating.join()


def queued_ids(r: redis.Redis) -> dict[str, bool]:
    """Request ids in the workers' queues → whether a worker has read the entry yet."""
    out: dict[str, bool] = {}
    for key in r.scan_iter(match=contracts.QUEUE_PATTERN):
        pending = {e["message_id"] for e in r.xpending_range(key, contracts.WORKER_GROUP, "-", "+", 10_000)}
        for entry_id, fields in r.xrange(key):
            out[QueuedRequest.from_json(fields[b"m"]).request_id] = entry_id in pending
    return out


# -- tenants ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("order", ["owner_first", "intruder_first"])
def test_another_tenants_request_id_names_another_request(
    stack: Stack, offline: LLMEngine, r: redis.Redis, order: str, stream: bool
) -> None:
    """Bob sends the id of Alice's request (concurrently, before or after her): he reads, attaches to
    and cancels only his own request; Alice's answer is complete and her own."""
    rid = f"shared-{order}-{stream}-{time.monotonic_ns()}"
    alice_prompt, bob_prompt = "def alice_handler(event):\n", "class BobModel(Base):\n"
    alice_ref, bob_ref = references(offline, [alice_prompt, bob_prompt], 48)
    assert alice_ref != bob_ref
    stack.wait_idle()

    async def main() -> tuple[Result, Result, Result]:
        async with client_for(stack) as client:
            first, second = ("alice", "bob") if order == "owner_first" else ("bob", "alice")
            prompts = {"alice": alice_prompt, "bob": bob_prompt}
            early = asyncio.ensure_future(complete(client, first, body(prompts[first], 48, stream), rid))
            await asyncio.sleep(0.5)
            late = asyncio.ensure_future(complete(client, second, body(prompts[second], 48, stream), rid))
            results = await asyncio.gather(early, late)
            alice, bob = results if first == "alice" else results[::-1]
            # After both ended: Bob retries the id once more and gets his own request again, not Alice's.
            again = await complete(client, "bob", body(bob_prompt, 48, stream), rid)
            return alice, bob, again

    alice, bob, again = asyncio.run(main())
    assert alice.ok and alice.finish == "length" and alice.text == alice_ref, alice
    assert bob.ok and bob.finish == "length" and bob.text == bob_ref, bob
    assert again.ok and again.text == bob_ref, again
    # Two requests, two output streams; the intruder's never contains the owner's text.
    assert "".join(e.text for e in output_events(r, "alice", rid)) == alice_ref
    assert "".join(e.text for e in output_events(r, "bob", rid)) == bob_ref


@pytest.mark.timeout(300)
@pytest.mark.parametrize("owner_stream", [True, False], ids=["stream", "whole"])
def test_an_intruder_that_leaves_does_not_cancel_the_owners_request(
    stack: Stack, offline: LLMEngine, r: redis.Redis, owner_stream: bool
) -> None:
    rid = f"owned-{owner_stream}-{time.monotonic_ns()}"
    prompt = LONG_PROMPTS[0]
    ref = references(offline, list(LONG_PROMPTS), LONG)[0]
    stack.wait_idle()

    async def main() -> Result:
        async with client_for(stack) as client:
            owner = asyncio.ensure_future(complete(client, "alice", body(prompt, LONG, owner_stream), rid))
            await asyncio.to_thread(wait_until, lambda: bool(output_events(r, "alice", rid)))
            # The same id and body from another tenant: it streams its own copy and walks away.
            await read_then_leave(stack.url, "bob", body(prompt, LONG), rid, 2)
            assert not any(e.is_last for e in output_events(r, "alice", rid))  # while Alice's was running
            return await owner

    owner = asyncio.run(main())
    assert owner.ok and owner.finish == "length" and owner.text == ref, owner
    wait_for_abort(r, "bob", rid)  # what Bob cancelled was his own request
    assert output_events(r, "alice", rid)[-1].finish_reason == "length"


# -- retries -----------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_request_dropped_mid_generation_and_retried_comes_back_complete(
    stack: Stack, offline: LLMEngine, r: redis.Redis, stream: bool
) -> None:
    rid = f"dropped-{stream}-{time.monotonic_ns()}"
    prompt = LONG_PROMPTS[1]
    ref = references(offline, list(LONG_PROMPTS), LONG)[1]
    stack.wait_idle()

    async def main() -> tuple[Result, int]:
        if stream:
            await read_then_leave(stack.url, "alice", body(prompt, LONG), rid, 8)
        else:  # the client gives up while the whole answer is being generated
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as quick:
                req = body(prompt, LONG, False)
                waiting = asyncio.ensure_future(
                    quick.post("/v1/completions", json=req, headers=headers("alice", rid))
                )
                await asyncio.to_thread(wait_until, lambda: len(output_events(r, "alice", rid)) >= 8)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
        cut = sum(len(e.token_ids) for e in wait_for_abort(r, "alice", rid))
        assert 0 < cut < LONG  # it was cut short mid-generation
        async with client_for(stack) as client:
            return await complete(client, "alice", body(prompt, LONG, stream), rid), cut

    retried, streamed = asyncio.run(main())
    # The retry continued it right after the tokens streamed before the abort.
    assert resume_cuts(stack.workdir, contracts.scoped_request_id("alice", rid)) == [streamed]
    ref = continued_reference(offline, prompt, ref, retried.text, [streamed])
    assert retried.ok and retried.finish == "length" and retried.text == ref, retried
    assert retried.completion_tokens == LONG


@pytest.mark.timeout(300)
def test_a_handler_whose_request_another_handler_cancelled_continues_it(
    stack: Stack, offline: LLMEngine, r: redis.Redis
) -> None:
    """Two handlers relay one request (a retry came while the first try's client was still there); the
    retry's client leaves and cancels it: the first handler continues it, and its answer is complete."""
    rid = f"two-handlers-{time.monotonic_ns()}"
    prompt = LONG_PROMPTS[2]
    ref = references(offline, list(LONG_PROMPTS), LONG)[2]
    stack.wait_idle()

    async def main() -> Result:
        async with client_for(stack) as client:
            first = asyncio.ensure_future(complete(client, "alice", body(prompt, LONG), rid))
            await asyncio.to_thread(wait_until, lambda: bool(output_events(r, "alice", rid)))
            await read_then_leave(stack.url, "alice", body(prompt, LONG), rid, 4)
            # It left mid-generation: nothing finished the request yet (its cancel's `abort` may already
            # be there, until the first handler continues the request and deletes it).
            ends = [e.finish_reason for e in output_events(r, "alice", rid) if e.is_last]
            assert ends in ([], ["abort"]), ends
            return await first

    first = asyncio.run(main())
    qid = contracts.scoped_request_id("alice", rid)
    assert f"continuing {qid} " in (stack.workdir / "gateway.log").read_text()
    cuts = resume_cuts(stack.workdir, qid)  # where its worker continued it
    assert len(cuts) == 1 and 0 < cuts[0] < LONG, cuts
    ref = continued_reference(offline, prompt, ref, first.text, cuts)
    assert first.ok and first.finish == "length" and first.text == ref, first


@pytest.mark.timeout(600)
def test_retries_after_a_gateway_kill_attach_to_the_queued_requests(
    stack: Stack, offline: LLMEngine, r: redis.Redis
) -> None:
    """`KILL_REQUESTS` streams (most of them waiting in Redis queues), the gateway SIGKILLed, restarted,
    and every client retries with its id: all complete, token-exact, none refused, none garbled."""
    n, max_tokens = KILL_REQUESTS, 24
    prompts = [f"# task {i}\ndef step_{i}(state):\n" for i in range(n)]
    refs = references(offline, prompts, max_tokens)
    ids = [f"kill-{i}-{time.monotonic_ns()}" for i in range(n)]
    stack.wait_idle()

    async def until(
        condition: Callable[[dict[str, bool]], bool], what: str, timeout: float
    ) -> dict[str, bool]:
        """Our requests in the queues (id → read yet) once `condition` holds of them."""
        deadline = time.monotonic() + timeout
        while not condition(ours := {k: v for k, v in queued_ids(r).items() if k.endswith(tuple(ids))}):
            assert time.monotonic() < deadline, f"not {what} within {timeout} s: {ours}"
            await asyncio.sleep(0.02)
        return ours

    async def before_kill() -> int:
        async with client_for(stack) as client:
            # The workers read nothing until every request is queued: a slow gateway (a loaded host) had
            # them read and finish each request as it came, and the kill found none unread.
            with frozen_workers(stack, r):
                tries = [
                    asyncio.ensure_future(complete(client, "alice", body(p, max_tokens), i))
                    for p, i in zip(prompts, ids, strict=True)
                ]
                await until(lambda ours: len(ours) == n, "all queued", 60)
            # Each worker takes what it can run or hold (`MAX_NUM_SEQS` + 8) and starts on it.
            queued = await until(any, "any read", 10)
            stack.kill_gateway()  # the clients lose their connections; the requests stay queued
            await asyncio.gather(*tries, return_exceptions=True)
            return sum(not read for read in queued.values())

    unread = asyncio.run(before_kill())
    stack.start_gateway()  # before any assertion: the module's other tests need a gateway
    stack.wait_ready(workers=2)
    assert unread > 0  # the kill found requests that no worker had read yet

    async def retry(client: httpx.AsyncClient, prompt: str, rid: str) -> tuple[Result, int]:
        """A client that retries with its id, honouring 429/503 with `Retry-After` (admission, not errors)."""
        for waits in range(30):
            res = await complete(client, "alice", body(prompt, max_tokens), rid)
            if res.status not in (429, 503):
                return res, waits
            await asyncio.sleep(1.0)
        return res, waits

    async def after_kill() -> list[tuple[Result, int]]:
        async with client_for(stack) as client:
            return await asyncio.gather(*(retry(client, p, i) for p, i in zip(prompts, ids, strict=True)))

    started = time.monotonic()
    results = asyncio.run(after_kill())
    completed = sum(res.ok and res.finish == "length" for res, _ in results)
    garbled = sum(res.ok and res.text != ref for (res, _), ref in zip(results, refs, strict=True))
    errors = [res for res, _ in results if not res.ok]
    stack.wait_idle()  # then no copy is left to run: each output stream holds exactly one generation

    def ran_once(events: list[OutputEvent]) -> bool:
        ends = [e.finish_reason for e in events if e.is_last]
        return ends == ["length"] and sum(len(e.token_ids) for e in events) == max_tokens

    twice = sum(not ran_once(output_events(r, "alice", i)) for i in ids)
    figures = {
        "sent": n,
        "queued_unread_at_kill": unread,
        "completed": completed,
        "errored": len(errors),
        "garbled": garbled,
        "ran_twice_or_failed_in_worker": twice,
        "retried_after_429_503": sum(w > 0 for _, w in results),
        "retry_wall_s": round(time.monotonic() - started, 1),
    }
    print("gateway-kill figures:", json.dumps(figures))
    assert not errors, errors[:3]
    assert garbled == 0 and completed == n and twice == 0, figures


# -- leaving while queued ----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_request_whose_client_leaves_while_it_is_queued_never_runs(
    stack: Stack, offline: LLMEngine, r: redis.Redis
) -> None:
    fillers_per_worker = MAX_NUM_SEQS + 8  # running + taken into the engine's waiting list
    victims = [f"queued-leaver-{i}-{time.monotonic_ns()}" for i in range(4)]
    prompt = "def retry_forever(fn):\n"
    (ref,) = references(offline, [prompt], 16)
    stack.wait_idle()

    async def main() -> Result:
        async with client_for(stack) as client:
            fillers = [
                asyncio.ensure_future(complete(client, "alice", body(f"# filler {i}\nwhile True:", 1500)))
                for i in range(2 * fillers_per_worker)
            ]
            try:
                deadline = time.monotonic() + 60
                while sum(queued_ids(r).values()) < 2 * fillers_per_worker:  # both workers full
                    assert time.monotonic() < deadline, queued_ids(r)
                    await asyncio.sleep(0.1)
                async with httpx.AsyncClient(base_url=stack.url, timeout=3) as quick:
                    qids = [contracts.scoped_request_id("bob", rid) for rid in victims]
                    leavers = [  # all at once: each waits out the same read timeout
                        asyncio.ensure_future(
                            quick.post(
                                "/v1/completions", json=body(prompt, 16, False), headers=headers("bob", rid)
                            )
                        )
                        for rid in victims
                    ]

                    def queued() -> bool:  # every leaver's entry in a queue, unread
                        return all(queued_ids(r).get(q) is False for q in qids)

                    await asyncio.to_thread(wait_until, queued)
                    for leaver in leavers:
                        with pytest.raises(httpx.ReadTimeout):  # queued, unread: the client gives up
                            await leaver
                    await asyncio.to_thread(wait_until, lambda: not set(qids) & set(queued_ids(r)))
                for rid in victims:
                    events = output_events(r, "bob", rid)
                    assert [e.finish_reason for e in events] == ["abort"] and not events[0].token_ids
            finally:
                for f in fillers:
                    f.cancel()
                await asyncio.gather(*fillers, return_exceptions=True)
            stack.wait_idle()
            for rid in victims:  # still nothing: no worker ever ran them
                assert [e.finish_reason for e in output_events(r, "bob", rid)] == ["abort"]
            # A retry of a dropped request runs it, from the start.
            return await complete(client, "bob", body(prompt, 16, False), victims[0])

    retried = asyncio.run(main())
    assert retried.ok and retried.finish == "length" and retried.text == ref, retried
