"""The engine's KV-block and adapter-residency changes as `KVEvent`s, for the routers' precise index.

The block manager records the hashes it publishes to and evicts from the prefix cache; the adapter cache
records each adapter's new tier when it moves between device, host and disk. `drain` turns what changed
since the last call into events: an adapter's move counts as "loaded" when it lands on a tier at least
as close to the device as the one last reported for it, "evicted" otherwise. `state` describes
everything at once — "cleared", then every cached block and every resident adapter — for a worker that
starts or comes back after a Redis outage, when routers may have lost the stream or missed events.
"""

from __future__ import annotations

import time

from loragate.contracts import AdapterTier, EventType, KVEvent
from worker.adapter_cache import AdapterCache
from worker.block_manager import BlockManager

STORED_CHUNK = 4096  # hashes per "stored" event of a full-state description
_RANK = {AdapterTier.DEVICE: 2, AdapterTier.HOST: 1, AdapterTier.DISK: 0}


class EngineEvents:
    def __init__(self, blocks: BlockManager, adapters: AdapterCache):
        self.blocks, self.adapters = blocks, adapters
        self._tiers: dict[str, AdapterTier] = {}  # each adapter's tier as last reported

    def drain(self) -> list[KVEvent]:
        """What changed since the last call (blocks stored, then evicted, then adapter moves in order)."""
        now = time.time()
        stored, evicted = self.blocks.drain_events()
        events = [
            KVEvent(t, hashes=tuple(h), ts=now)
            for t, h in ((EventType.STORED, stored), (EventType.EVICTED, evicted))
            if h
        ]
        for name, tier in self.adapters.tier_events:
            moved_up = _RANK[tier] >= _RANK[self._tiers.get(name, AdapterTier.DISK)]
            kind = EventType.ADAPTER_LOADED if moved_up else EventType.ADAPTER_EVICTED
            events.append(KVEvent(kind, adapter=name, tier=tier, ts=now))
            self._tiers[name] = tier
        self.adapters.tier_events.clear()
        return events

    def state(self) -> list[KVEvent]:
        """Everything held now; drops the changes not yet drained (this description covers them)."""
        self.drain()
        now = time.time()
        events = [KVEvent(EventType.CLEARED, ts=now)]
        hashes = list(self.blocks.cached)
        for i in range(0, len(hashes), STORED_CHUNK):
            events.append(KVEvent(EventType.STORED, hashes=tuple(hashes[i : i + STORED_CHUNK]), ts=now))
        device = list(self.adapters.device_lru)
        host = [name for name in self.adapters.host if name not in device]
        for names, tier in ((host, AdapterTier.HOST), (device, AdapterTier.DEVICE)):
            for name in names:
                events.append(KVEvent(EventType.ADAPTER_LOADED, adapter=name, tier=tier, ts=now))
        return events
