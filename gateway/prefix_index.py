"""An approximate per-worker prefix index: which worker was last sent each prompt block.

Block hashes are chained (`loragate.hashing`), so the longest run of a request's leading hashes that a
worker was sent estimates how many prompt tokens it can take from its prefix cache. Bounded: an LRU of
at most `capacity` hashes. Approximate because it records routing, not the worker's actual KV contents
(evictions are not seen); the routing policies replace it with the workers' KV events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class ApproxPrefixIndex:
    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def cached_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Worker id -> length of the leading run of `hashes` last routed to it."""
        runs: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            owner = self._owner.get(h)
            if owner is None or (alive is not None and owner not in alive):
                break
            alive = {owner}
            runs[owner] = i + 1
        return runs

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._owner[h] = worker_id
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
