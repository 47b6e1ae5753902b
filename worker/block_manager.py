"""KV block allocation with reference counts and prefix caching.

Every block has a ref count. Freed blocks go to the back of an LRU free list but keep their hash, so a
later request with the same prefix (same tokens, same adapter) can take them back: a cache hit. New
allocations take from the front of the free list — the least recently freed block — and only then drop
its hash: eviction of cached blocks is LRU, and only of unreferenced ones. Block hashes are chained and
include the adapter id (`loragate.hashing`), exactly as the gateway computes them for routing.

A block is published to the cache only once its KV has been computed (`commit`), so no request can hit
a block whose contents are not yet written. A sequence that still wants prompt logprobs takes no hit
over the positions whose logits it needs (they must be computed), but publishes its blocks as any other.
"""

from __future__ import annotations

from collections import OrderedDict

from loragate.hashing import block_hashes
from worker.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hit_tokens = 0
        self.queried_tokens = 0
        # Hashes published / evicted since the last `drain_events` (the worker streams them to routers).
        self.stored_hashes: list[int] = []
        self.evicted_hashes: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens of KV."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict the cached contents
                del self.cached[old]
                self.block_hash[block] = None
                self.evicted_hashes.append(old)
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def allocate_prefix(self, seq: Sequence) -> None:
        """Take the longest cached run of `seq`'s leading full blocks (leaving >= 1 token to compute)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(seq)
        usable = (seq.num_tokens - 1) // self.block_size
        if seq.wants_prompt_logits:  # positions whose logits are wanted must be computed, not hit
            usable = min(usable, seq.next_prompt_logit // self.block_size)
        for h in seq.block_hashes[:usable]:
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        hits = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = hits * self.block_size
        seq.num_registered_blocks = hits

    def record_admission(self, seq: Sequence) -> None:
        """Count a prefix lookup once, when its sequence is really admitted (a lookup that is rolled back
        because the KV pool is full is retried later and must not count twice)."""
        self.hit_tokens += seq.num_cached_tokens
        self.queried_tokens += seq.num_tokens

    def free_seq(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; tail blocks first so shared prefixes stay cached longest."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def commit(self, seq: Sequence) -> None:
        """Publish `seq`'s fully computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq)
        for i in range(seq.num_registered_blocks, full):
            h, block = seq.block_hashes[i], seq.block_table[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h
                self.stored_hashes.append(h)
        seq.num_registered_blocks = full

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, evicted) block hashes since the last call."""
        stored, evicted = self.stored_hashes, self.evicted_hashes
        self.stored_hashes, self.evicted_hashes = [], []
        return stored, evicted

    def _extend_hashes(self, seq: Sequence) -> None:
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:
            seq.block_hashes = block_hashes(seq.token_ids, self.block_size, seq.adapter, seq.block_hashes)
