"""The worker's KV-block and adapter-residency events on their Redis stream (`lg:events:{id}`).

The engine makes the events (`LLMEngine.drain_events`: what changed; `LLMEngine.state_events`: all it
holds, after a "cleared"); this log holds a step's events back until the next step's pipeline (so they
never share a new request's first-token write) and writes them, capped to the stream's length limit.
`snapshot` is what a worker sends when it starts or comes back after a Redis outage, when routers may have
lost the stream or missed events.
"""

from __future__ import annotations

import redis
from redis.client import Pipeline

from loragate import contracts
from loragate.contracts import KVEvent
from worker.engine import LLMEngine


class KVEventLog:
    def __init__(self, model: str, worker_id: str):
        self.key = contracts.events(model, worker_id)
        self.deferred: list[KVEvent] = []  # the last step's, sent with the next step's outputs

    def snapshot(self, engine: LLMEngine) -> list[KVEvent]:
        """Everything the engine holds now; drops the changes not yet sent (the snapshot covers them)."""
        self.deferred = []
        return engine.state_events()

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
