"""Reference prefix-cache hit rates for the routing simulator: what one worker with the whole fleet's
cache capacity would reach, fed every request in arrival order with its blocks cached at once.

- `lru_hit_rate`, the simulator's oracle: that worker with LRU, as real workers evict. It is what routing
  would reach if it never split a prefix over workers nor moved one for load. Not a strict bound: N
  separate LRU caches can beat one shared LRU slightly (they keep one stream's one-off blocks from
  evicting another's hot prefixes), which shows in small, heavily loaded caches.
- `belady_hit_rate`, the bound: that worker with Belady's clairvoyant replacement (MIN with bypass: a
  block whose next use is farthest, or never, is the one not kept). It maximises block hits for its
  capacity, and a fleet of N caches of C blocks holds no more than one cache of N·C, so no placement can
  beat it (up to admission reordering: the fleet admits in roughly, not exactly, arrival order). Because
  every request that uses a block also uses the block's parent, a parent's next use is never later than
  its child's; ties evict the deeper block, so the cache stays prefix-closed and a request's cached
  blocks are exactly its leading run. The gap between the two is what LRU loses to one-off blocks
  (unique prompt suffixes), which no routing can win back.

Hits are counted as the fleet counts them: the leading run of cached blocks, at most `prompt - 1` tokens.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from loadtest.sim_workload import BLOCK_SIZE, SimRequest

NEVER = float("inf")


def _hit_tokens(request: SimRequest, run: int) -> int:
    return min(run * BLOCK_SIZE, request.prompt_tokens - 1)


def _next_uses(requests: Sequence[SimRequest]) -> list[list[float]]:
    """For each request and each of its blocks, the index of the next request using that block."""
    following: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        hashes = requests[i].block_hashes
        out[i] = [following.get(h, NEVER) for h in hashes]
        for h in hashes:
            following[h] = i
    return out


def belady_hit_rate(requests: Sequence[SimRequest], capacity_blocks: int, warmup: int = 0) -> float:
    """Cached prompt tokens / prompt tokens of one Belady-managed cache of `capacity_blocks`, counted
    from request `warmup` on."""
    cached: dict[int, tuple[float, int]] = {}  # hash -> its current heap key
    heap: list[tuple[tuple[float, int], int]] = []  # ((-next use, -depth), hash): top = best victim
    hit = total = 0
    for i, (request, next_uses) in enumerate(zip(requests, _next_uses(requests), strict=True)):
        run = 0
        while run < len(request.block_hashes) and request.block_hashes[run] in cached:
            run += 1
        if i >= warmup:
            hit += _hit_tokens(request, run)
            total += request.prompt_tokens
        for depth, (h, next_use) in enumerate(zip(request.block_hashes, next_uses, strict=True)):
            key = (-next_use, -depth)
            if next_use == NEVER:
                cached.pop(h, None)
                continue
            if h not in cached:
                while len(cached) >= capacity_blocks and heap:
                    victim_key, victim = heap[0]
                    if cached.get(victim) != victim_key:
                        heapq.heappop(heap)  # stale entry
                    elif victim_key < key:  # used later than this block (or never): drop it
                        heapq.heappop(heap)
                        del cached[victim]
                    else:
                        break
                if len(cached) >= capacity_blocks:
                    continue  # bypass: every cached block is needed sooner
            cached[h] = key
            heapq.heappush(heap, (key, h))
    return hit / total if total else 0.0


def lru_hit_rate(requests: Sequence[SimRequest], capacity_blocks: int, warmup: int = 0) -> float:
    """Cached prompt tokens / prompt tokens of one LRU cache of `capacity_blocks`, counted from request
    `warmup` on."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for i, request in enumerate(requests):
        run = 0
        while run < len(request.block_hashes) and request.block_hashes[run] in cache:
            run += 1
        if i >= warmup:
            hit += _hit_tokens(request, run)
            total += request.prompt_tokens
        for h in request.block_hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total if total else 0.0
