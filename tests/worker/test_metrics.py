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
        (m.name, s.labels.get("state") or s.labels.get("kind") or s.labels.get("tier") or ""): s.value
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
    }
    assert snap.kv_blocks_free == 64 - 2  # m2 holds its 31 tokens' two blocks
