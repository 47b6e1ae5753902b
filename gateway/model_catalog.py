"""Resolve the `model` field: a base model, `base:adapter`, a registered adapter name, or `auto`.

Adapters live in the registry (`lg:adapters`, `{base}:{name}` → `AdapterRecord`), cached here for a
second at a time. A bare adapter name must be unambiguous across bases. Tenants only see and use
adapters that allow them.

A base model is known while a worker serves it, and also after: this gateway remembers every base it saw
live, and workers record theirs in `lg:models` with each heartbeat (for gateways that started while none
was live). A known base with no live worker resolves, so the request gets 503 with `Retry-After` (a
worker may be restarting, or Redis just came back); only a name never served is 404.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.errors import APIError, bad_request
from gateway.fleet import Fleet
from loragate import contracts
from loragate.messages import AdapterRecord

AUTO = "auto"


@dataclass(frozen=True)
class Target:
    base: str
    adapter: AdapterRecord | None

    @property
    def model_id(self) -> str:
        return self.adapter.key if self.adapter else self.base


@dataclass(frozen=True)
class ModelShape:
    """What the gateway needs of a base model to take its requests: the tokenizer's directory, the KV
    block size (the prefix hashes), the context length."""

    model_dir: str
    block_size: int
    max_model_len: int


class ModelCatalog:
    def __init__(self, r: aioredis.Redis, fleet: Fleet, ttl_s: float = 1.0):
        self.redis, self.fleet, self.ttl_s = r, fleet, ttl_s
        self._adapters: dict[str, AdapterRecord] = {}
        self._loaded_at = 0.0
        self._seen: set[str] = set()  # base models this gateway saw served
        self._remembered: set[str] = set()  # base models in `lg:models`, seen within MODEL_MEMORY_S
        self._remembered_at = 0.0

    async def adapters(self, fresh: bool = False) -> dict[str, AdapterRecord]:
        if fresh or time.monotonic() - self._loaded_at > self.ttl_s:
            raw = await self.redis.hgetall(contracts.ADAPTERS)
            self._adapters = {k.decode(): AdapterRecord.from_json(v) for k, v in raw.items()}
            self._loaded_at = time.monotonic()
        return self._adapters

    async def remembered(self) -> set[str]:
        """Base models the fleet served, live or not (`lg:models`, this gateway's memory)."""
        if time.monotonic() - self._remembered_at > self.ttl_s:
            raw = await self.redis.hgetall(contracts.MODELS)
            horizon = time.time() - contracts.MODEL_MEMORY_S
            self._remembered = {k.decode() for k, v in raw.items() if _seen_at(v) > horizon}
            self._remembered_at = time.monotonic()
        return self._seen | self._remembered

    async def shape(self, base: str) -> ModelShape | None:
        """`base` as its workers last described it in `lg:models` (None: never, or by a worker too old
        to say its block size), for requests that wait for a worker to start."""
        raw = await self.redis.hget(contracts.MODELS, base)
        try:
            seen = json.loads(raw) if raw is not None else None
            if not isinstance(seen, dict):
                return None
            return ModelShape(str(seen["model_dir"]), int(seen["block_size"]), int(seen["max_model_len"]))
        except (ValueError, KeyError, TypeError):
            return None

    async def resolve(self, model: object, tenant: str) -> Target:
        if not isinstance(model, str) or not model:
            raise bad_request("'model' must be a non-empty string.", param="model")
        bases = self.fleet.models()
        self._seen.update(bases)
        if model == AUTO:
            return Target(self._auto_base(), None)
        if model in bases or model in self._seen:
            return Target(model, None)
        adapters = await self.adapters()
        record = adapters.get(model)
        if record is None and ":" not in model:
            matches = [r for r in adapters.values() if r.name == model and r.allows(tenant)]
            if len(matches) > 1:
                choices = ", ".join(sorted(r.key for r in matches))
                raise bad_request(
                    f"Adapter name '{model}' is ambiguous; use one of: {choices}.", param="model"
                )
            record = matches[0] if matches else None
        if record is None and model in await self.remembered():  # served before, no worker now: 503
            return Target(model, None)
        if record is None:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        if not record.allows(tenant):
            raise APIError(
                403,
                f"You are not allowed to use the adapter '{record.key}'.",
                param="model",
                code="adapter_not_allowed",
            )
        return Target(record.base, record)

    def _auto_base(self) -> str:
        """Until difficulty routing: the base model with the least load per live worker."""
        per_model: dict[str, list[int]] = {}
        for w in self.fleet.workers.values():
            if not w.state.draining:
                per_model.setdefault(w.state.model, []).append(w.load)
        if not per_model:
            raise APIError(503, "No worker is available to serve 'auto'.", code="no_worker")
        return min(per_model, key=lambda m: (sum(per_model[m]) / len(per_model[m]), m))


def _seen_at(raw: bytes) -> float:
    try:
        return float(json.loads(raw)["at"])
    except (ValueError, KeyError, TypeError):
        return 0.0
