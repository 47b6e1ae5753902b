"""Routing on the real stack (2 workers): prefix affinity from the workers' KV events, adapter residency,
explainable decisions, and a policy PUT that changes routing without a restart."""

from __future__ import annotations

import json
import time

import httpx

from tests.e2e.stack import ADMIN_TOKEN, Stack
from tests.waiting import wait_for

KEY = {"Authorization": "Bearer sk-test-alice"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SYSTEM = "".join(f"def helper_{i}(value):\n    return value * {i}\n\n" for i in range(30))


def complete(stack: Stack, prompt: str, model: str = "tiny") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{stack.url}/v1/completions", json=body, headers=KEY, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def test_shared_prefix_requests_follow_the_worker_that_holds_it(stack: Stack) -> None:
    stack.wait_idle()
    first = complete(stack, SYSTEM + "# first question")
    holder = first.headers["x-loragate-worker"]
    time.sleep(0.6)  # the worker's KV events reach the gateway's prefix index
    for i in range(4):
        resp = complete(stack, SYSTEM + f"# follow-up {i}")
        assert resp.headers["x-loragate-worker"] == holder
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    decision = httpx.get(
        f"{stack.url}/admin/decisions/{resp.headers['x-loragate-decision']}", headers=ADMIN
    ).json()
    assert decision["worker_id"] == holder and decision["outcome"] == "routed"
    assert decision["predicted_cached_tokens"] > 0
    others = [s for w, s in decision["scores"]["prefix"].items() if w != holder]
    assert all(decision["scores"]["prefix"][holder] > s for s in others)
    deadline = time.monotonic() + 10  # KV events arrive asynchronously (streams are rediscovered every 2 s)
    while True:
        stats = httpx.get(f"{stack.url}/admin/policy/stats", headers=ADMIN).json()
        if stats["kv_events_applied"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats["kv_events_applied"] > 0 and stats["actual_cached_tokens"] > 0


def test_adapter_requests_go_where_the_adapter_is_resident(stack: Stack) -> None:
    stack.wait_idle()
    first = complete(stack, "x = 1", model="tiny:o-down-r16")
    resident = first.headers["x-loragate-worker"]

    def on_device() -> bool:  # reading the fleet refreshes the gateway's own view, which routing uses
        workers = httpx.get(f"{stack.url}/admin/workers", headers=ADMIN).json()["workers"]
        device = [a for w in workers if w["worker_id"] == resident for a in w["adapters_device"]]
        return any(a.endswith("o-down-r16") for a in device)

    wait_for(
        on_device, "the worker's heartbeat to report the adapter on its device", timeout=15, interval=0.2
    )
    for i in range(3):
        resp = complete(stack, f"unrelated prompt {i} " * 3, model="tiny:o-down-r16")
        assert resp.headers["x-loragate-worker"] == resident
        decision = httpx.get(
            f"{stack.url}/admin/decisions/{resp.headers['x-loragate-decision']}", headers=ADMIN
        ).json()
        assert decision["adapter_tier"] == "device"


def test_policy_put_changes_routing_without_restart(stack: Stack) -> None:
    stack.wait_idle()
    original = httpx.get(f"{stack.url}/admin/policy", headers=ADMIN).json()
    doc = json.loads(json.dumps(original["document"]))
    doc["default_profile"] = "round-robin"
    bad = {**doc, "default_profile": "no-such-profile"}
    refused = httpx.put(f"{stack.url}/admin/policy", json=bad, headers=ADMIN)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "default_profile"
    put = httpx.put(f"{stack.url}/admin/policy", json=doc, headers=ADMIN)
    assert put.status_code == 201
    time.sleep(1.2)
    workers = {complete(stack, SYSTEM + f"# rr {i}").headers["x-loragate-worker"] for i in range(4)}
    assert workers == {"w1", "w2"}  # round-robin ignores the prefix that pulled everything to one worker
    history = httpx.get(f"{stack.url}/admin/policy/history", headers=ADMIN).json()["versions"]
    assert history[-1]["version"] == put.json()["version"] and history[-1]["active"]
    if original["version"] is not None:
        assert (
            httpx.post(
                f"{stack.url}/admin/policy/rollback", json={"version": original["version"]}, headers=ADMIN
            ).status_code
            == 201
        )
    else:
        assert (
            httpx.put(f"{stack.url}/admin/policy", json=original["document"], headers=ADMIN).status_code
            == 201
        )
    time.sleep(1.2)
    assert (
        httpx.get(f"{stack.url}/admin/policy", headers=ADMIN).json()["document"]["default_profile"]
        != "round-robin"
    )


def test_shadow_policy_reports_disagreement(stack: Stack) -> None:
    stack.wait_idle()
    # A prefix of its own, held by exactly one worker: the active policy follows it every time, the
    # round-robin shadow only every other time, so their predicted cache hits must differ.
    prefix = "".join(f"class Shadow{i}:\n    size = {i}\n\n" for i in range(40))
    holder = complete(stack, prefix + "# warm").headers["x-loragate-worker"]
    time.sleep(0.6)  # the holder's KV events reach the gateway's prefix index
    original = httpx.get(f"{stack.url}/admin/policy", headers=ADMIN).json()["document"]
    shadow = {**original, "default_profile": "round-robin"}
    assert httpx.put(f"{stack.url}/admin/policy/shadow", json=shadow, headers=ADMIN).status_code == 201
    time.sleep(0.3)
    for i in range(6):
        assert complete(stack, prefix + f"# shadowed {i}").headers["x-loragate-worker"] == holder
    report = httpx.get(f"{stack.url}/admin/policy/shadow", headers=ADMIN).json()["report"]
    assert report["compared"] == 6 and report["different_worker"] >= 1
    assert report["active_predicted_cached_tokens"] > report["shadow_predicted_cached_tokens"] > 0, report
    assert httpx.delete(f"{stack.url}/admin/policy/shadow", headers=ADMIN).status_code == 204


def test_auto_picks_a_tier_by_difficulty_and_explains_it(stack: Stack) -> None:
    easy = httpx.post(
        f"{stack.url}/v1/chat/completions",
        headers=KEY,
        timeout=60,
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert easy.status_code == 200, easy.text
    model, _, score = easy.headers["x-loragate-model"].partition("; difficulty ")
    assert model == "tiny" and 0.0 <= float(score) < 0.4  # the easy band of the default `auto` alias
    assert easy.json()["model"] == "tiny"
    hard_prompt = (
        "Prove that the integral of x^2 dx from 0 to 1 equals 1/3, step by step, then write "
        "a Python function with unit tests that checks it numerically:\n```python\ndef f(x):"
    )
    hard = httpx.post(
        f"{stack.url}/v1/chat/completions",
        headers=KEY,
        timeout=60,
        json={"model": "auto", "messages": [{"role": "user", "content": hard_prompt}], "max_tokens": 400},
    )
    assert hard.status_code == 200, hard.text
    model, _, score = hard.headers["x-loragate-model"].partition("; difficulty ")
    # The hard band's model (`smollm2`) has no worker in this stack, so the nearest tier with one serves it.
    assert float(score) >= 0.4 and model == "tiny"
