"""The routing policy in a real Redis: versions, history, rollback and the shadow, each change announced;
a PolicyHolder follows the active version, and a stored document that no longer parses keeps the policy
it holds instead of taking the gateway down."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.policy_store import PolicyHolder, PolicyStore
from loragate import contracts
from policies.default_policy import DEFAULT_POLICY
from policies.document import Policy, parse_policy

DEFAULT = {"name": "default"}


def _name(document: dict[str, Any]) -> str:
    """A stand-in parser: the document's name, and KeyError for a document without one."""
    return str(document["name"])


def _run(redis_url: str, body: Callable[[aioredis.Redis, PolicyStore], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            return await asyncio.wait_for(body(r, PolicyStore(r)), 20)
        finally:
            await r.aclose()

    return asyncio.run(main())


async def _next_message(pubsub: Any) -> str:
    while True:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        if message is not None:
            return message["data"].decode()


def test_put_stores_a_new_active_version_and_announces_it(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: PolicyStore) -> tuple[Any, ...]:
        pubsub = r.pubsub()
        await pubsub.subscribe(contracts.POLICY_CHANGED)
        assert await store.active_version() is None
        first = await store.put({"name": "a"}, note="first")
        second = await store.put({"name": "b"})
        announced = [await _next_message(pubsub), await _next_message(pubsub)]
        await pubsub.aclose()
        return first, second, await store.active_version(), await store.get(1), await store.get(9), announced

    first, second, active, entry, missing, announced = _run(redis_url, body)
    assert (first, second, active, missing, announced) == (1, 2, 2, None, ["active", "active"])
    assert entry["document"] == {"name": "a"} and entry["note"] == "first" and entry["version"] == 1
    assert abs(entry["created_at"] - time.time()) < 60


def test_history_is_in_version_order_and_marks_the_active_one(redis_url: str) -> None:
    async def body(_: aioredis.Redis, store: PolicyStore) -> list[dict[str, Any]]:
        for i in range(11):  # versions 1..11: string order would put 10 before 2
            await store.put({"name": f"p{i}"}, note=f"n{i}")
        return await store.history()

    history = _run(redis_url, body)
    assert [e["version"] for e in history] == list(range(1, 12))
    assert [e["active"] for e in history] == [False] * 10 + [True]
    assert history[0]["note"] == "n0" and set(history[0]) == {"version", "created_at", "note", "active"}


def test_rollback_is_a_new_version_with_the_old_document(redis_url: str) -> None:
    async def body(_: aioredis.Redis, store: PolicyStore) -> tuple[Any, ...]:
        await store.put({"name": "a"})
        await store.put({"name": "b"})
        new = await store.rollback(1)
        unknown = await store.rollback(99)
        return new, unknown, await store.get(3), await store.active_version()

    new, unknown, entry, active = _run(redis_url, body)
    assert (new, unknown, active) == (3, None, 3)
    assert entry["document"] == {"name": "a"} and entry["note"] == "rollback to version 1"


def test_shadow_set_read_and_cleared_each_announced(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: PolicyStore) -> list[Any]:
        pubsub = r.pubsub()
        await pubsub.subscribe(contracts.POLICY_CHANGED)
        seen = [await store.shadow()]
        await store.set_shadow({"name": "s"})
        seen.append(await store.shadow())
        await store.set_shadow(None)
        seen.append(await store.shadow())
        seen.append([await _next_message(pubsub), await _next_message(pubsub)])
        await pubsub.aclose()
        return seen

    assert _run(redis_url, body) == [None, {"name": "s"}, None, ["shadow", "shadow"]]


def test_holder_starts_with_the_default_and_reloads_the_active_and_shadow(redis_url: str) -> None:
    async def body(_: aioredis.Redis, store: PolicyStore) -> list[Any]:
        holder = PolicyHolder(store, _name, DEFAULT, redis_url)
        seen = [(holder.policy, holder.version, holder.shadow)]
        await store.put({"name": "v1"})
        await store.set_shadow({"name": "s1"})
        await holder.reload()
        seen.append((holder.policy, holder.version, holder.shadow))
        await store.set_shadow(None)
        await holder.reload()
        seen.append((holder.policy, holder.document, holder.shadow, holder.shadow_document))
        return seen

    assert _run(redis_url, body) == [
        ("default", None, None),
        ("v1", 1, "s1"),
        ("v1", {"name": "v1"}, None, None),
    ]


def test_a_started_holder_applies_a_change_from_another_gateway_within_seconds(redis_url: str) -> None:
    async def body(_: aioredis.Redis, store: PolicyStore) -> tuple[str, float]:
        holder = PolicyHolder(store, _name, DEFAULT, redis_url)
        await holder.start()
        try:
            start = time.monotonic()
            await store.put({"name": "elsewhere"})
            while holder.version != 1:
                await asyncio.sleep(0.02)
            return holder.policy, time.monotonic() - start
        finally:
            await holder.stop()

    policy, took = _run(redis_url, body)
    assert policy == "elsewhere" and took < 3


def test_a_stored_document_that_does_not_parse_keeps_the_policy_held(redis_url: str) -> None:
    async def body(r: aioredis.Redis, store: PolicyStore) -> tuple[Any, ...]:
        holder = PolicyHolder(store, _name, DEFAULT, redis_url)
        await store.put({"name": "good"})
        await holder.reload()
        await store.put({"no name": True})  # stored bypassing validation, e.g. by an older gateway
        with pytest.raises(KeyError):
            await holder.reload()
        await holder.start()  # the start-up and background reloads survive it
        await asyncio.sleep(1.3)  # one poll
        await holder.stop()
        return holder.policy, holder.version

    assert _run(redis_url, body) == ("good", 1)


def test_a_policy_stored_with_the_old_alias_field_name_still_loads(redis_url: str) -> None:
    old = copy.deepcopy(DEFAULT_POLICY)
    old["aliases"]["auto"]["tiers"] = old["aliases"]["auto"].pop("rungs")

    async def body(_: aioredis.Redis, store: PolicyStore) -> Policy:
        holder = PolicyHolder(store, parse_policy, DEFAULT_POLICY, redis_url)
        await store.put(old)
        await holder.reload()
        assert holder.version == 1
        return holder.policy

    assert _run(redis_url, body).aliases["auto"].models == ("tiny", "smollm2")


def test_policies_stored_before_the_hash_tags_are_carried_over_once(redis_url: str) -> None:
    """A gateway upgraded on a Redis that holds policy versions under the old, untagged keys copies them to
    the new ones, leaves newer ones alone, and a second copy (another gateway) changes nothing."""

    async def body(r: aioredis.Redis, store: PolicyStore) -> tuple[Any, ...]:
        old = {v: k for k, v in contracts.LEGACY_POLICY_KEYS.items()}
        entry = {"version": 3, "document": {"name": "kept"}, "created_at": 1.0, "note": ""}
        await r.hset(old[contracts.POLICY], "3", json.dumps(entry))
        await r.set(old[contracts.POLICY_ACTIVE], 3)
        await r.set(old[contracts.POLICY_SEQ], 3)
        first = await store.migrate()
        again = await store.migrate()
        version = await store.put({"name": "next"})  # the counter went on from the old one
        await r.set(old[contracts.POLICY_ACTIVE], 1)  # an old gateway still writing: the new key wins
        late = await store.migrate()
        return (
            first,
            again,
            late,
            version,
            await store.active_version(),
            (await store.get(3) or {})["document"],
        )

    first, again, late, version, active, kept = _run(redis_url, body)
    assert (first, again, late) == (3, 0, 0) and (version, active) == (4, 4) and kept == {"name": "kept"}
