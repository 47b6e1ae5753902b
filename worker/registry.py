"""The worker's view of the adapter registry (`lg:adapters`): resolve a key to files, keep pins loaded.

Adapters are named `{base}:{name}` everywhere (engine, prefix hashes, routing), so a key means the same
weights on every worker. `publish_directory` registers every PEFT adapter found under a directory (for
`loragate worker --adapters DIR`); `sync` refreshes records and pre-loads pinned adapters into host memory.
`republish` announces this base's adapters again after Redis came back: the directory's, and the records
this worker knew (registered through the admin API), each only where the key is missing (a Redis that
restarted without its data lost them; one that kept them keeps any change made meanwhile).
"""

from __future__ import annotations

from pathlib import Path

import redis

from loragate import contracts
from loragate.messages import AdapterRecord
from worker.engine import LLMEngine
from worker.lora import AdapterError


class AdapterRegistry:
    def __init__(self, r: redis.Redis, base: str):
        self.redis, self.base = r, base
        self.records: dict[str, AdapterRecord] = {}
        self.pinned: set[str] = set()
        self.directory: tuple[Path, tuple[str, ...]] | None = None  # what `publish_directory` was given

    def publish_directory(self, directory: Path, pin: tuple[str, ...] = ()) -> list[str]:
        """Register each adapter sub-directory as `{base}:{dirname}` unless that key already exists."""
        self.directory = (directory, pin)
        added = []
        for sub in sorted(p for p in directory.iterdir() if (p / "adapter_config.json").exists()):
            record = AdapterRecord(
                name=sub.name, base=self.base, path=str(sub.resolve()), pinned=sub.name in pin
            )
            if self.redis.hsetnx(contracts.ADAPTERS, record.key, record.to_json()):
                added.append(record.key)
        return added

    def republish(self) -> None:
        known = [rec for rec in self.records.values() if rec.base == self.base]
        if known:
            pipe = self.redis.pipeline(transaction=False)
            for rec in known:
                pipe.hsetnx(contracts.ADAPTERS, rec.key, rec.to_json())
            pipe.execute()
        if self.directory is not None:
            self.publish_directory(*self.directory)

    def sync(self, engine: LLMEngine) -> None:
        raw = self.redis.hgetall(contracts.ADAPTERS)
        self.records = {k.decode(): AdapterRecord.from_json(v) for k, v in raw.items()}
        pinned = {k for k, rec in self.records.items() if rec.pinned and rec.base == self.base}
        for key in pinned - self.pinned:
            try:
                self.ensure_registered(engine, key)
                engine.preload_adapter(key)
            except AdapterError:
                continue  # a bad pinned adapter fails its requests, not the worker
        self.pinned = pinned
        engine.pin_adapters(pinned)

    def ensure_registered(self, engine: LLMEngine, key: str) -> str:
        """Make `key` known to the engine (from the registry); returns the engine's adapter name."""
        record = self.records.get(key)
        if record is None:
            raw = self.redis.hget(contracts.ADAPTERS, key)
            if raw is None:
                raise AdapterError(f"adapter {key!r} is not registered")
            record = self.records[key] = AdapterRecord.from_json(raw)
        if record.base != self.base:
            raise AdapterError(f"adapter {key!r} is for base model {record.base!r}, not {self.base!r}")
        path = Path(record.path)
        if engine.adapter_path(key) != path:
            engine.register_adapter(key, path)
        return key
