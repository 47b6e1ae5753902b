"""The worker's KV-block and adapter-residency events, for the routers' precise index (`lg:events:{id}`).

`collect` turns what changed since the last call (blocks published to or evicted from the prefix cache,
adapters moving between device, host and disk) into events; `snapshot` states everything at once —
"cleared", then every cached block and resident adapter — for a worker that starts or comes back after
a Redis outage, when routers may have lost the stream or missed events.
"""

from __future__ import annotations

import time

import redis
from redis.client import Pipeline

from loragate import contracts
from loragate.contracts import AdapterTier, EventType, KVEvent
from worker.engine import LLMEngine

STORED_CHUNK = 4096  # hashes per "stored" event of a snapshot
_RANK = {AdapterTier.DEVICE: 2, AdapterTier.HOST: 1, AdapterTier.DISK: 0}


class KVEventLog:
    def __init__(self, worker_id: str):
        self.key = contracts.events(worker_id)
        self.deferred: list[KVEvent] = []  # the last step's, sent with the next step's outputs
        self._tiers: dict[str, AdapterTier] = {}  # each adapter's tier as last reported

    def collect(self, engine: LLMEngine) -> list[KVEvent]:
        now = time.time()
        stored, evicted = engine.blocks.drain_events()
        events = [
            KVEvent(t, hashes=tuple(h), ts=now)
            for t, h in ((EventType.STORED, stored), (EventType.EVICTED, evicted))
            if h
        ]
        for name, tier in engine.adapters.tier_events:
            moved_up = _RANK[tier] >= _RANK[self._tiers.get(name, AdapterTier.DISK)]
            kind = EventType.ADAPTER_LOADED if moved_up else EventType.ADAPTER_EVICTED
            events.append(KVEvent(kind, adapter=name, tier=tier, ts=now))
            self._tiers[name] = tier
        engine.adapters.tier_events.clear()
        return events

    def snapshot(self, engine: LLMEngine) -> list[KVEvent]:
        """Everything the engine holds now; drops the changes not yet sent (the snapshot covers them)."""
        self.collect(engine)
        self.deferred = []
        now = time.time()
        events = [KVEvent(EventType.CLEARED, ts=now)]
        hashes = list(engine.blocks.cached)
        for i in range(0, len(hashes), STORED_CHUNK):
            events.append(KVEvent(EventType.STORED, hashes=tuple(hashes[i : i + STORED_CHUNK]), ts=now))
        device = list(engine.adapters.device_lru)
        host = [name for name in engine.adapters.host if name not in device]
        for names, tier in ((host, AdapterTier.HOST), (device, AdapterTier.DEVICE)):
            for name in names:
                events.append(KVEvent(EventType.ADAPTER_LOADED, adapter=name, tier=tier, ts=now))
        return events

    def add(self, pipe: Pipeline, events: list[KVEvent]) -> None:
        for event in events:
            pipe.xadd(
                self.key,
                {contracts.EVENTS_FIELD: event.to_json()},
                maxlen=contracts.EVENTS_MAXLEN,
                approximate=True,
            )

    def emit(self, r: redis.Redis, events: list[KVEvent]) -> None:
        if events:
            pipe = r.pipeline(transaction=False)
            self.add(pipe, events)
            pipe.execute()
