"""The worker's Prometheus collector reports the engine's snapshot, one sample per (family, label)."""

from __future__ import annotations

from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.metrics import EngineCollector
from worker.modelzoo.make import ZooPaths


def test_collector_reports_the_engine_snapshot(zoo: ZooPaths) -> None:
    name = zoo.adapter_names("tiny")[0]
    engine = LLMEngine(
        zoo.base("tiny"), EngineConfig(adapters={name: zoo.adapter("tiny", name)}, num_kv_blocks=64)
    )
    prompt = tuple(range(100, 130))
    engine.generate([Request("m1", prompt, SamplingParams(max_tokens=4, ignore_eos=True), name)])
    engine.add_request(Request("m2", prompt, SamplingParams(max_tokens=4, ignore_eos=True), name))
    engine.step()  # m2 runs, its prompt's first block a prefix-cache hit
    snap = engine.snapshot()
    samples = {
        (m.name, next((s.labels[k] for k in ("state", "kind", "tier", "path") if k in s.labels), "")): s.value
        for m in EngineCollector(engine, "w1").collect()
        for s in m.samples
        if s.labels["worker"] == "w1"
    }
    assert samples == {
        ("loragate_engine_kv_blocks", "free"): snap.kv_blocks_free,
        ("loragate_engine_kv_blocks", "used"): 64 - snap.kv_blocks_free,
        ("loragate_engine_sequences", "running"): 1,
        ("loragate_engine_sequences", "waiting"): 0,
        ("loragate_engine_prefix_tokens", "hit"): 16,
        ("loragate_engine_prefix_tokens", "queried"): 60,
        ("loragate_engine_adapter_loads", "disk"): 1,
        ("loragate_engine_adapter_loads", "host"): 1,
        ("loragate_engine_adapter_evictions", "device"): 0,
        ("loragate_engine_adapter_evictions", "host"): 0,
        ("loragate_engine_preemptions", ""): 0,
        ("loragate_engine_generated_tokens", ""): 5,
        ("loragate_engine_steps", "graph"): 0,  # no decode graphs on a CPU
        ("loragate_engine_steps", "eager"): 5,  # m1's prefill and 3 decodes, m2's prefill
    }
    assert snap.kv_blocks_free == 64 - 2  # m2 holds its 31 tokens' two blocks


def test_other_threads_read_the_snapshot_of_the_last_step(zoo: ZooPaths) -> None:
    """The metrics thread never walks the engine's containers: it reads the snapshot the engine's own
    thread took at the end of its last step, which a request added since does not change."""
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=64))
    assert engine.last_snapshot == engine.snapshot()  # before any step: the state at start
    engine.add_request(Request("s1", tuple(range(100, 120)), SamplingParams(max_tokens=4, ignore_eos=True)))
    assert engine.last_snapshot.waiting == 0 and engine.snapshot().waiting == 1
    engine.step()
    assert engine.last_snapshot == engine.snapshot()
    assert engine.last_snapshot.running == 1 and engine.last_snapshot.steps == 1
