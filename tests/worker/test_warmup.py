"""The engine's warm-up (`worker.warmup`): it runs the ladder of batch shapes, adapters and prompt lengths
through real steps, and leaves a fresh engine's state behind, so what follows is as without it."""

from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path

import pytest

from kernels import triton_variants
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths
from worker.warmup import Wave, ladder, warm_up

ROOT = Path(__file__).resolve().parents[2]


def requests(adapters: list[str]) -> list[Request]:
    rng = random.Random(3)
    return [
        Request(
            f"r{i}",
            tuple(rng.randrange(8, 8000) for _ in range(rng.randrange(5, 60))),
            SamplingParams(max_tokens=12, ignore_eos=True),
            adapter=adapters[i % len(adapters)] if i % 3 else None,
        )
        for i in range(9)
    ]


def test_ladder_covers_batch_sizes_prompt_lengths_and_adapter_mixes() -> None:
    waves = ladder(max_num_seqs=48, block_size=16, max_loras=16, max_model_len=2048)
    assert sorted({w.seqs for w in waves}) == [1, 2, 4, 8, 16, 32, 48]
    assert sorted({w.prompt_len for w in waves}) == [12, 28, 88]  # contexts of 1, 2 and 6 blocks
    assert sorted({w.adapters for w in waves}) == [0, 1, 8]
    assert len(waves) == 7 * 3 * 3
    # Few slots and a short context bound the ladder; no adapters, no adapter waves.
    assert {w.adapters for w in ladder(4, 16, 0, 2048)} == {0}
    assert max(w.prompt_len for w in ladder(4, 16, 2, 40)) == 37  # room for its 3 output tokens
    assert Wave(4, 12, 2) in ladder(4, 16, 2, 2048)


@pytest.mark.timeout(300)
def test_warm_engine_starts_fresh_and_generates_what_a_cold_one_does(zoo: ZooPaths) -> None:
    names = zoo.adapter_names("tiny")
    adapters = {n: zoo.adapter("tiny", n) for n in names}
    base = EngineConfig(adapters=adapters, num_kv_blocks=160, max_num_seqs=6, max_loras=3)
    warm = LLMEngine(zoo.base("tiny"), dataclasses.replace(base, warmup=True))
    cold = LLMEngine(zoo.base("tiny"), base)  # on a CPU: no warm-up unless asked
    assert cold.warmup is None
    report = warm.warmup
    assert report is not None and report.waves == len(ladder(6, 16, 3, warm.max_model_len))
    assert report.steps >= 2 * report.waves  # a prefill and a decode step at least per wave

    # Nothing of the warm-up is left: no requests, KV blocks, cached prefixes, adapters, counters, events.
    snap = warm.snapshot()
    assert not warm.has_work() and snap.running == snap.waiting == 0
    assert snap.kv_blocks_free == snap.kv_blocks_total == 160 and snap.cached_blocks == 0
    assert snap.adapters_device == snap.adapters_host == ()
    assert (snap.steps, snap.generated_tokens, snap.prefix_queried_tokens, snap.adapter_device_loads) == (
        0,
        0,
        0,
        0,
    )
    assert warm.drain_events() == []
    assert not any(name.startswith("\x00") for name in warm.adapters.paths)
    assert sum(warm.adapters.host_ranks["q_proj"]) == 0  # every slot empty again

    # The same greedy tokens, the same prefix-cache and adapter accounting, as an engine never warmed.
    got, want = warm.generate(requests(names)), cold.generate(requests(names))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.cached_tokens for c in got] == [c.cached_tokens for c in want]
    w, c = warm.snapshot(), cold.snapshot()
    assert (w.adapter_disk_reads, w.adapter_device_loads, w.cached_blocks) == (
        c.adapter_disk_reads,
        c.adapter_device_loads,
        c.cached_blocks,
    )


def test_warm_up_refuses_an_engine_with_work(zoo: ZooPaths) -> None:
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=64, max_num_seqs=2))
    engine.add_request(Request("busy", (10, 11, 12), SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(engine)
    assert engine.has_work() and "busy" in engine.requests


def test_variant_count_covers_every_triton_kernel() -> None:
    """Every `@triton.jit` kernel of `kernels/` is in a module the warm-up check counts."""
    counted = {m.__name__.rsplit(".", 1)[-1] for m in triton_variants.MODULES}
    with_kernels = set()
    for path in (ROOT / "kernels").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    if ast.unparse(target) == "triton.jit":
                        with_kernels.add(path.stem)
    assert with_kernels and with_kernels <= counted | {"triton_util"}  # triton_util: device helpers only
    assert triton_variants.compiled_variants() == {}  # the CPU compiles none (interpreter or no GPU)


def test_warm_up_fits_a_small_kv_pool(zoo: ZooPaths) -> None:
    """A pool of 4 blocks (64 tokens) holds none of the ladder's 6-block prompts: they are cut to fit."""
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=4, max_num_seqs=2, warmup=True))
    assert engine.warmup is not None and engine.warmup.steps > 0
    assert engine.snapshot().kv_blocks_free == 4
