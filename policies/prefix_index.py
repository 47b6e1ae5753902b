"""A per-worker index of the KV blocks (by chained block hash) each worker holds, for prefix-aware routing.

Block hashes are chained (`loragate.hashing`): a hash names the whole prompt prefix up to the end of its
block, under one adapter. So the number of prompt tokens a worker can take from its prefix cache is
`block_size ×` the longest leading run of the request's hashes that the worker holds
(`cached_blocks`), and the prefix scorer turns that into a score.

Two ways to feed it, usable together:

* precise: `apply_event(worker_id, event)` with the worker's KV events (`loragate.contracts.KVEvent`,
  read from `lg:events:{worker_id}`): `stored` adds blocks, `evicted` removes them, `cleared` drops the
  worker's blocks and adapters; `adapter_loaded`/`adapter_evicted` keep each adapter's latest tier on
  the worker.
* approximate (events off): `record_routed(worker_id, hashes)` after each routing decision — what was
  sent where is what the worker will most likely hold. With events on, recording routed blocks as well
  covers the gap between routing and the worker's `stored` event, when bursts share a new prefix.

Memory is bounded: each worker keeps at most `capacity` hashes, least recently stored or routed dropped
first (an LRU, as the workers' own caches are), and `forget_worker` drops a worker that left the fleet.
Not thread-safe: owned by one gateway task.

Parameters:
    capacity: hashes kept per worker (default 100_000: ~1.6 M tokens of 16-token blocks; a worker's own
        KV cache is usually much smaller, so precise mode rarely evicts here).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from loragate.contracts import EventType, KVEvent


class PrefixIndex:
    def __init__(self, capacity: int = 100_000):
        if capacity < 1:
            raise ValueError("capacity must be ≥ 1")
        self.capacity = capacity
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._adapters: dict[str, dict[str, str]] = {}  # worker -> adapter -> "device" | "host"

    # -- feeding ---------------------------------------------------------------------------------
    def apply_event(self, worker_id: str, event: KVEvent) -> None:
        if event.type is EventType.STORED:
            self._add(worker_id, event.hashes)
        elif event.type is EventType.EVICTED:
            blocks = self._blocks.get(worker_id, OrderedDict())
            for h in event.hashes:
                blocks.pop(h, None)
        elif event.type is EventType.CLEARED:
            self.forget_worker(worker_id)
        elif event.adapter is not None:
            adapters = self._adapters.setdefault(worker_id, {})
            if event.tier == "disk":
                adapters.pop(event.adapter, None)
            elif event.tier is not None:
                adapters[event.adapter] = event.tier

    def record_routed(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Approximate mode: the request with these block hashes was sent to `worker_id`."""
        self._add(worker_id, hashes)

    def forget_worker(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
        self._adapters.pop(worker_id, None)

    def _add(self, worker_id: str, hashes: Iterable[int]) -> None:
        blocks = self._blocks.setdefault(worker_id, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    # -- queries ---------------------------------------------------------------------------------
    def cached_blocks(self, worker_id: str, hashes: Sequence[int]) -> int:
        """The length of the longest leading run of `hashes` the worker holds."""
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return 0
        run = 0
        for h in hashes:
            if h not in blocks:
                break
            run += 1
        return run

    def cached_by_worker(self, worker_ids: Iterable[str], hashes: Sequence[int]) -> dict[str, int]:
        return {w: self.cached_blocks(w, hashes) for w in worker_ids}

    def resident_adapters(self, worker_id: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """(on device, in host memory only) from adapter events, sorted; None when none were seen."""
        adapters = self._adapters.get(worker_id)
        if adapters is None:
            return None
        device = tuple(sorted(a for a, t in adapters.items() if t == "device"))
        host = tuple(sorted(a for a, t in adapters.items() if t == "host"))
        return device, host

    def size(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(sorted(self._blocks.keys() | self._adapters.keys()))
