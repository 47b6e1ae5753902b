"""Worker → gateway KV and adapter residency events: the JSON on `lg:events:{worker_id}`.

A worker appends one stream entry per event with a single field `e` holding the event's JSON
(`XADD lg:events:{worker_id} MAXLEN ~ N * e <json>`), the same layout as the output streams:

    {"type": "stored",  "hashes": [h1, h2, ...], "ts": 1718000000.0}   blocks now in its prefix cache
    {"type": "evicted", "hashes": [h1, ...],     "ts": ...}            blocks dropped from it
    {"type": "cleared", "ts": ...}                                      everything dropped (start, reset)
    {"type": "adapter_loaded",  "adapter": "tiny:a", "tier": "device", "ts": ...}   moved to a faster tier
    {"type": "adapter_evicted", "adapter": "tiny:a", "tier": "host",   "ts": ...}   moved to a slower tier

`hashes` are the `loragate.hashing.block_hash` values of full blocks (unsigned 128-bit JSON integers),
keyed by the adapter key `"{base}:{name}"` or none, exactly as the gateway computes them. In adapter
events `tier` is where the adapter is *after* the event, its fastest copy: `"device"`, `"host"` or
`"disk"` (no longer resident); the reader keeps the latest tier per adapter, so events are idempotent
and the type only says which way it moved. `ts` is unix time, optional (0). A worker sends `cleared`
when it starts, so a restarted worker's old blocks are forgotten. Torch-free, so the worker and the
gateway share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class EventType(StrEnum):
    STORED = "stored"
    EVICTED = "evicted"
    CLEARED = "cleared"
    ADAPTER_LOADED = "adapter_loaded"
    ADAPTER_EVICTED = "adapter_evicted"


BLOCK_EVENTS = frozenset({EventType.STORED, EventType.EVICTED})
ADAPTER_EVENTS = frozenset({EventType.ADAPTER_LOADED, EventType.ADAPTER_EVICTED})
ADAPTER_TIERS = frozenset({"device", "host", "disk"})


@dataclass(frozen=True, slots=True)
class KVEvent:
    type: EventType
    hashes: tuple[int, ...] = ()  # stored / evicted
    adapter: str | None = None  # adapter_loaded / adapter_evicted
    tier: str | None = None  # with adapter events: "device" | "host" | "disk", where it is now
    ts: float = 0.0

    def __post_init__(self) -> None:
        if self.type in ADAPTER_EVENTS and (not self.adapter or self.tier not in ADAPTER_TIERS):
            raise ValueError(f"{self.type} needs an adapter and a tier in {sorted(ADAPTER_TIERS)}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": str(self.type)}
        if self.type in BLOCK_EVENTS:
            d["hashes"] = list(self.hashes)
        if self.type in ADAPTER_EVENTS:
            d["adapter"], d["tier"] = self.adapter, self.tier
        if self.ts:
            d["ts"] = self.ts
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KVEvent:
        """Raises ValueError on an unknown type or malformed fields (a reader skips such an entry)."""
        kind = EventType(str(d.get("type")))
        hashes = d.get("hashes", ())
        if not isinstance(hashes, list | tuple) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes
        ):
            raise ValueError("hashes must be a list of integers")
        return KVEvent(kind, tuple(hashes), d.get("adapter"), d.get("tier"), float(d.get("ts", 0.0)))

    @staticmethod
    def from_json(raw: str | bytes) -> KVEvent:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("an event is a JSON object")
        return KVEvent.from_dict(d)
