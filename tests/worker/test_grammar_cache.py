"""The compiled-grammar cache: hits refresh an entry, the least recently used goes first once the byte
budget is passed, and a grammar larger than the whole budget is not kept."""

from __future__ import annotations

import pytest

from worker.grammar_cache import GrammarCache

# (puts as (guide, size), with "get:<guide>" a hit in between; the guides kept at the end)
CASES = {
    "fits": ([("a", 4), ("b", 4)], {"a", "b"}),
    "oldest-out": ([("a", 4), ("b", 4), ("c", 4)], {"b", "c"}),
    "hit-refreshes": ([("a", 4), ("b", 4), ("get:a", 0), ("c", 4)], {"a", "c"}),
    "too-big": ([("a", 4), ("huge", 11)], {"a"}),
    "replaced": ([("a", 4), ("a", 8), ("b", 2)], {"a", "b"}),
}


@pytest.mark.parametrize(("ops", "kept"), list(CASES.values()), ids=list(CASES))
def test_the_cache_keeps_the_most_recently_used_within_its_budget(
    ops: list[tuple[str, int]], kept: set[str]
) -> None:
    cache = GrammarCache(max_bytes=10)
    for guide, size in ops:
        if guide.startswith("get:"):
            assert cache.get(guide[4:]) == f"g-{guide[4:]}"
        else:
            cache.put(guide, f"g-{guide}", size)
    assert {g for g in ("a", "b", "c", "huge") if g in cache} == kept
    assert cache.size_bytes <= 10 and len(cache) == len(kept)
    assert cache.get("missing") is None
