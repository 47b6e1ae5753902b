"""AdapterCache: the plan evicts least-recently-used adapters not needed now; host tier is byte-bounded."""

from __future__ import annotations

import pytest
import torch

from kernels.sgmv_native import bf16_pairs_ready, slot_pairs
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


@pytest.mark.skipif(not bf16_pairs_ready(), reason="neither AMX nor AVX512-BF16: no B in rank pairs is kept")
def test_bf16_slots_keep_b_in_rank_pairs_beside_b_where_the_kernels_read_them(zoo: ZooPaths) -> None:
    """What the native bf16 kernel reads on AMX or AVX512-BF16 follows every slot write, and is zero in an
    emptied slot."""
    cfg = load_model_config(zoo.base("tiny"))
    cache = AdapterCache(cfg, 2, 64, 1 << 30, torch.bfloat16, "cpu")
    names = zoo.adapter_names("tiny")
    for name in names:
        cache.register(name, zoo.adapter("tiny", name))
    shapes = cfg.module_shapes()
    fits = {m for m, (fan_in, fan_out) in shapes.items() if fan_in % 32 == 0 and fan_out % 16 == 0}
    assert fits and fits != set(shapes)  # tiny's down_proj reads 688 values a row: AVX only
    assert {m for m, stack in cache.stacks.items() if stack.b_pairs is not None} == fits
    for wanted in (names[:2], names[2:4]):  # the second pair evicts the first from both slots
        cache.apply(cache.plan(wanted))
        for module in fits:
            stack = cache.stacks[module]
            assert stack.b_pairs is not None
            assert torch.equal(stack.b_pairs, slot_pairs(stack.b, stack.ranks.tolist()))
    assert any(int(stack.ranks.min()) == 0 for stack in cache.stacks.values())  # some module unadapted


def test_fp32_slots_keep_no_rank_pairs(zoo: ZooPaths) -> None:
    assert all(stack.b_pairs is None for stack in make_cache(zoo).stacks.values())
