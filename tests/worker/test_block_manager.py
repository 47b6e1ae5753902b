"""BlockManager: allocation, sharing by prefix hash, LRU eviction of unreferenced cached blocks."""

from __future__ import annotations

from loragate.types import Request
from worker.block_manager import BlockManager
from worker.sequence import Sequence

BS = 4


def seq(tokens: list[int], adapter: str | None = None, rid: str = "r") -> Sequence:
    return Sequence.from_request(Request(rid, tuple(tokens), adapter=adapter))


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """What the engine does for a step of n tokens: slots, then commit after the forward."""
    bm.append_slots(s, n)
    s.num_computed_tokens += n
    bm.commit(s)


def test_append_allocates_blocks_on_demand() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq(list(range(10)))
    assert bm.blocks_needed(s, 10) == 3
    bm.append_slots(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    s.num_computed_tokens = 5
    bm.append_slots(s, 3)  # 8 tokens: still 2 blocks
    assert len(s.block_table) == 2
    s.num_computed_tokens = 8
    bm.append_slots(s, 1)
    assert len(s.block_table) == 3


def test_can_append_refuses_beyond_pool() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    s = seq(list(range(12)))
    assert bm.can_append(s, 8)
    assert not bm.can_append(s, 9)


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq(list(range(12)), rid="a")
    bm.allocate_prefix(a)
    assert a.num_cached_tokens == 0
    compute(bm, a, 12)
    b = seq(list(range(12)), rid="b")  # identical prompt: 3 full blocks cached, but one token must run
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 8
    assert b.block_table == a.block_table[:2]
    assert all(bm.ref_counts[blk] == 2 for blk in b.block_table)
    c = seq([*range(8), 99, 98, 97, 96, 95], rid="c")  # shares two blocks, diverges in the third
    bm.allocate_prefix(c)
    assert c.num_cached_tokens == 8


def test_prefix_hashes_include_the_adapter() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq(list(range(9)), adapter="x", rid="a")
    compute(bm, a, 9)
    same = seq(list(range(9)), adapter="x", rid="b")
    other = seq(list(range(9)), adapter="y", rid="c")
    base = seq(list(range(9)), rid="d")
    for s in (same, other, base):
        bm.allocate_prefix(s)
    assert same.num_cached_tokens == 8
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_blocks_are_published_only_when_computed() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq(list(range(12)), rid="a")
    bm.append_slots(a, 12)  # slots reserved, KV not yet computed
    b = seq(list(range(12)), rid="b")
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 0
    bm.free_seq(b)
    a.num_computed_tokens = 6  # a chunk of 6: only the first block is complete
    bm.commit(a)
    c = seq(list(range(12)), rid="c")
    bm.allocate_prefix(c)
    assert c.num_cached_tokens == 4


def test_freed_blocks_stay_cached_until_reused_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(list(range(8)), rid="a")
    compute(bm, a, 8)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    again = seq([*range(8), 1], rid="a2")
    bm.allocate_prefix(again)
    assert again.num_cached_tokens == 8  # still cached after free
    bm.free_seq(again)
    # Allocating 3 fresh blocks takes the never-used block first, then evicts the least recently freed.
    big = seq([50 + i for i in range(12)], rid="big")
    bm.append_slots(big, 12)
    probe = seq([*range(8), 1], rid="p")
    bm.allocate_prefix(probe)
    assert probe.num_cached_tokens < 8


def test_free_releases_tail_first_so_prefix_survives_longest() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = seq(list(range(12)), rid="a")
    compute(bm, a, 12)
    first, middle, last = a.block_table
    bm.free_seq(a)
    assert list(bm.free) == [last, middle, first]
    # One new block: it must be the tail block that is evicted, not the prefix.
    x = seq([77] * 4, rid="x")
    bm.append_slots(x, 4)
    assert x.block_table == [last]
    b = seq([*range(8), 5], rid="b")
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 8


def test_shared_block_is_not_freed_while_referenced() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(list(range(9)), rid="a")
    compute(bm, a, 9)
    b = seq(list(range(9)), rid="b")
    bm.allocate_prefix(b)
    shared = b.block_table[0]
    bm.free_seq(a)
    assert bm.ref_counts[shared] == 1 and shared not in bm.free
    bm.free_seq(b)
    assert bm.ref_counts[shared] == 0 and shared in bm.free


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = seq(list(range(9)), rid="a")
    compute(bm, a, 9)
    b = seq(list(range(9)), rid="b")
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 0 and not bm.cached
