"""A worker's own Prometheus metrics (`loragate worker --metrics-port N`), from the engine's snapshot of its
last step: KV blocks used/free, sequences running/waiting, prefix-cache hit vs queried prompt tokens, adapter
loads by tier (disk → host memory, host → device slot) and evictions by tier, preemptions, generated
tokens, and steps by path (replayed from a CUDA graph, or eager)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.engine import LLMEngine


class EngineCollector(Collector):
    def __init__(self, engine: LLMEngine, worker_id: str):
        self.engine, self.worker_id = engine, worker_id

    def collect(self) -> Iterator[Metric]:
        snap, w = self.engine.last_snapshot, [self.worker_id]  # scraped on another thread
        kv = GaugeMetricFamily("loragate_engine_kv_blocks", "KV blocks", labels=["worker", "state"])
        kv.add_metric([*w, "free"], snap.kv_blocks_free)
        kv.add_metric([*w, "used"], snap.kv_blocks_total - snap.kv_blocks_free)
        seqs = GaugeMetricFamily(
            "loragate_engine_sequences", "Sequences in the engine", labels=["worker", "state"]
        )
        seqs.add_metric([*w, "running"], snap.running)
        seqs.add_metric([*w, "waiting"], snap.waiting)
        prefix = CounterMetricFamily(
            "loragate_engine_prefix_tokens",
            "Prompt tokens looked up in the prefix cache",
            labels=["worker", "kind"],
        )
        prefix.add_metric([*w, "hit"], snap.prefix_hit_tokens)
        prefix.add_metric([*w, "queried"], snap.prefix_queried_tokens)
        loads = CounterMetricFamily(
            "loragate_engine_adapter_loads", "Adapter loads by source tier", labels=["worker", "tier"]
        )
        loads.add_metric([*w, "disk"], snap.adapter_disk_reads)
        loads.add_metric([*w, "host"], snap.adapter_device_loads)
        evictions = CounterMetricFamily(
            "loragate_engine_adapter_evictions", "Adapter evictions by tier", labels=["worker", "tier"]
        )
        evictions.add_metric([*w, "device"], snap.adapter_device_evictions)
        evictions.add_metric([*w, "host"], snap.adapter_host_evictions)
        preempt = CounterMetricFamily("loragate_engine_preemptions", "Sequences preempted", labels=["worker"])
        preempt.add_metric(w, snap.preemptions)
        tokens = CounterMetricFamily(
            "loragate_engine_generated_tokens", "Tokens generated", labels=["worker"]
        )
        tokens.add_metric(w, snap.generated_tokens)
        steps = CounterMetricFamily(
            "loragate_engine_steps",
            "Engine steps, by how they ran: replayed from a CUDA graph, or eagerly",
            labels=["worker", "path"],
        )
        steps.add_metric([*w, "graph"], snap.graph_steps)
        steps.add_metric([*w, "eager"], snap.steps - snap.graph_steps)
        yield from (kv, seqs, prefix, loads, evictions, preempt, tokens, steps)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def serve_metrics(engine: LLMEngine, worker_id: str, port: int, host: str = "0.0.0.0") -> None:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, worker_id))
    start_http_server(port, addr=host, registry=registry)
