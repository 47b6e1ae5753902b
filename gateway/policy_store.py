"""The routing policy in Redis: versioned, validated before it is stored, applied by every gateway.

`PUT` validates the document (a bad one never reaches Redis), stores it as the next version in the
`lg:policy` hash, makes it active and publishes on `lg:policy:changed`. Every gateway holds the parsed
active (and shadow) policy in a `PolicyHolder`, reloaded on that message and, as a fallback for a missed
message, by polling the active version every second — so a change applies everywhere within a second,
without restarts. Rollback re-activates an earlier version as a new version (history stays linear).
Through a Redis outage a gateway keeps the policy it holds; the listener reconnects with backoff and
the poll goes on, so changes apply again as soon as Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from loragate import contracts
from loragate.redis_retry import Backoff, OutageLog, is_outage
from loragate.redis_url import connect_pubsub

log = logging.getLogger("loragate.gateway")
P = TypeVar("P")


class PolicyStore:
    def __init__(self, r: aioredis.Redis):
        self.redis = r

    async def migrate(self) -> int:
        """Copy the policy keys an earlier loragate wrote (untagged) to today's, where those are absent;
        returns how many it copied. Key by key (`DUMP`/`RESTORE ... NX`-style), so it runs on a cluster too,
        and any number of gateways may run it at once."""
        copied = 0
        for old, new in contracts.LEGACY_POLICY_KEYS.items():
            dumped = await self.redis.dump(old)
            if dumped is None:
                continue
            try:
                await self.redis.restore(new, 0, dumped)
                copied += 1
            except ResponseError as e:  # BUSYKEY: already there (another gateway copied it, or newer)
                if "BUSYKEY" not in str(e):
                    raise
        if copied:
            log.info("copied %d policy keys from the layout before hash tags", copied)
        return copied

    async def active_version(self) -> int | None:
        raw = await self.redis.get(contracts.POLICY_ACTIVE)
        return int(raw) if raw is not None else None

    async def get(self, version: int) -> dict[str, Any] | None:
        raw = await self.redis.hget(contracts.POLICY, str(version))
        return json.loads(raw) if raw is not None else None

    async def put(self, document: dict[str, Any], note: str = "") -> int:
        version = int(await self.redis.incr(contracts.POLICY_SEQ))
        entry = {"version": version, "document": document, "created_at": time.time(), "note": note}
        pipe = self.redis.pipeline(transaction=True)  # both keys in the slot of the tag `{policy}`
        pipe.hset(contracts.POLICY, str(version), json.dumps(entry))
        pipe.set(contracts.POLICY_ACTIVE, version)
        await pipe.execute()
        await self.redis.publish(contracts.POLICY_CHANGED, "active")  # gateways also poll every second
        return version

    async def history(self) -> list[dict[str, Any]]:
        raw = await self.redis.hgetall(contracts.POLICY)
        entries = [json.loads(v) for v in raw.values()]
        active = await self.active_version()
        out = [
            {
                "version": e["version"],
                "created_at": e["created_at"],
                "note": e.get("note", ""),
                "active": e["version"] == active,
            }
            for e in entries
        ]
        return sorted(out, key=lambda e: e["version"])

    async def rollback(self, version: int) -> int | None:
        entry = await self.get(version)
        if entry is None:
            return None
        return await self.put(entry["document"], note=f"rollback to version {version}")

    async def shadow(self) -> dict[str, Any] | None:
        raw = await self.redis.get(contracts.POLICY_SHADOW)
        return json.loads(raw) if raw is not None else None

    async def set_shadow(self, document: dict[str, Any] | None) -> None:
        if document is None:
            await self.redis.delete(contracts.POLICY_SHADOW)
        else:
            await self.redis.set(contracts.POLICY_SHADOW, json.dumps(document))
        await self.redis.publish(contracts.POLICY_CHANGED, "shadow")


class PolicyHolder(Generic[P]):
    """The parsed active and shadow policies of this gateway process, kept current."""

    def __init__(
        self,
        store: PolicyStore,
        parse: Callable[[dict[str, Any]], P],
        default: dict[str, Any],
        redis_url: str,
    ):
        self.store, self.parse, self.default_doc = store, parse, default
        self.policy: P = parse(default)
        self.version: int | None = None
        self.document: dict[str, Any] = default
        self.shadow: P | None = None
        self.shadow_document: dict[str, Any] | None = None
        self._redis_url = redis_url
        self._tasks: list[asyncio.Task[None]] = []
        self._outage = OutageLog(log, "policy reload")

    async def reload(self) -> None:
        version = await self.store.active_version()
        if version is not None and version != self.version:
            entry = await self.store.get(version)
            if entry is not None:
                self.policy = self.parse(entry["document"])
                self.document, self.version = entry["document"], version
                log.info("policy version %d active", version)
        shadow = await self.store.shadow()
        if shadow != self.shadow_document:
            self.shadow_document = shadow
            self.shadow = self.parse(shadow) if shadow is not None else None

    async def start(self) -> None:
        try:
            await self.store.migrate()
        except Exception as e:  # Redis down: the next start copies them
            log.warning("could not look for policy keys of an earlier version: %r", e)
        await self._safe_reload()  # Redis down: the default policy until it is back
        self._tasks = [asyncio.create_task(self._listen()), asyncio.create_task(self._poll())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _listen(self) -> None:
        backoff, outage = Backoff(), OutageLog(log, "policy listener")
        client = connect_pubsub(self._redis_url)
        try:
            while True:
                pubsub = client.pubsub()
                try:
                    await pubsub.subscribe(contracts.POLICY_CHANGED)
                    if outage.recovered() is not None:
                        backoff.reset()
                        await self._safe_reload()  # a change may have been published meanwhile
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            await self._safe_reload()
                except Exception as e:
                    if not is_outage(e):
                        log.exception("policy listener failed")
                    outage.failed(e)
                    await asyncio.sleep(backoff.next())
                finally:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
        finally:
            await client.aclose()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self._safe_reload()

    async def _safe_reload(self) -> None:
        try:
            await self.reload()
        except Exception as e:  # a stored document that no longer parses must not take the gateway down
            if is_outage(e):
                self._outage.failed(e)
                return
            log.exception("policy reload failed; keeping version %s", self.version)
        self._outage.recovered()
