"""AdapterCache: the plan evicts least-recently-used adapters not needed now; host tier is byte-bounded."""

from __future__ import annotations

import pytest
import torch

from worker.adapter_cache import AdapterCache
from worker.models import load_model_config
from worker.modelzoo.make import ZooPaths


def make_cache(zoo: ZooPaths, slots: int = 2, host_bytes: int = 1 << 30) -> AdapterCache:
    cfg = load_model_config(zoo.base("tiny"))
    cache = AdapterCache(cfg, slots, 64, host_bytes, torch.float32, "cpu")
    for name in zoo.adapter_names("tiny"):
        cache.register(name, zoo.adapter("tiny", name))
    return cache


def test_plan_loads_into_free_slots_then_evicts_lru(zoo: ZooPaths) -> None:
    a, b, c = zoo.adapter_names("tiny")[:3]
    cache = make_cache(zoo)
    assert cache.acquire([a]) == {a: 0}
    assert cache.acquire([b]) == {b: 1}
    cache.acquire([a])  # a is now the most recently used
    plan = cache.plan([c])
    assert plan.evict == ((b, 1),) and plan.load == ((c, 1),)
    cache.apply(plan)
    assert cache.tier(b) == "host" and cache.tier(c) == "device"
    assert cache.device_evictions == 1 and cache.device_loads == 3


def test_plan_never_evicts_an_adapter_needed_in_the_same_step(zoo: ZooPaths) -> None:
    a, b, c = zoo.adapter_names("tiny")[:3]
    cache = make_cache(zoo)
    cache.acquire([a, b])
    plan = cache.plan([b, c])
    assert plan.evict == ((a, 0),)
    with pytest.raises(ValueError, match="slots"):
        cache.plan([a, b, c])


def test_slot_weights_and_rank_table_follow_the_adapter(zoo: ZooPaths) -> None:
    names = zoo.adapter_names("tiny")
    cache = make_cache(zoo)
    slots = cache.acquire(names[:2])
    for name, slot in slots.items():
        w = cache.ensure_host(name)
        for module, stack in cache.stacks.items():
            lora = w.modules.get(module)
            assert int(stack.ranks[slot]) == (lora.rank if lora else 0)
            if lora:
                assert torch.equal(stack.a[:, slot, : lora.rank], lora.a)
                assert stack.scale[slot].item() == pytest.approx(lora.scale)
                assert not stack.a[:, slot, lora.rank :].any()


def test_host_tier_is_bounded_in_bytes_and_reloads_from_disk(zoo: ZooPaths) -> None:
    names = zoo.adapter_names("tiny")
    one = make_cache(zoo).ensure_host(names[0]).nbytes
    cache = make_cache(zoo, host_bytes=one)
    cache.ensure_host(names[0])
    cache.ensure_host(names[1])
    assert list(cache.host) == [names[1]]
    assert cache.tier(names[0]) == "disk" and cache.host_evictions == 1
    cache.ensure_host(names[0])
    assert cache.disk_reads == 3
