"""Prometheus metrics of the gateway, served at `/metrics` (what each means: README, "Operate it").

Request outcomes, TTFT / ITL / end-to-end histograms, prompt tokens cached vs computed, per-worker queue
depth (the autoscaling signal), KV blocks and batch sizes (read from the fleet snapshot at scrape time),
routing decisions by outcome branch, the adapter tier of chosen workers, predicted vs actual cached
tokens, and refusals. Per-adapter series are capped: the first `top_adapters` adapters to reach
`min_requests` requests keep their own label, every other adapter is reported as `other`, so hundreds of
adapters cannot blow up cardinality. One registry per gateway process (no global registry).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet import Fleet

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class AdapterLabeler:
    """Maps adapter keys to bounded label values: the first N busy adapters by name, the rest `other`."""

    def __init__(self, top_adapters: int = 20, min_requests: int = 1):
        self.top, self.min_requests = top_adapters, min_requests
        self.counts: Tally[str] = Tally()
        self.labelled: set[str] = set()

    def label(self, adapter: str | None) -> str:
        if adapter is None:
            return "none"
        if adapter in self.labelled:
            return adapter
        self.counts[adapter] += 1
        if len(self.labelled) < self.top and self.counts[adapter] >= self.min_requests:
            self.labelled.add(adapter)
            del self.counts[adapter]
            return adapter
        if len(self.counts) > 10 * self.top:  # keep the tally of unlabelled adapters bounded too
            self.counts = Tally(dict(self.counts.most_common(self.top)))
        return "other"


class _FleetCollector(Collector):
    """Worker gauges read from the gateway's fleet snapshot at scrape time."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "loragate_worker_queue_depth", "Outstanding requests per worker", labels=["worker", "model"]
        )
        kv = GaugeMetricFamily(
            "loragate_worker_kv_blocks", "KV blocks per worker", labels=["worker", "state"]
        )
        running = GaugeMetricFamily(
            "loragate_worker_running", "Sequences running per worker", labels=["worker"]
        )
        waiting = GaugeMetricFamily(
            "loragate_worker_waiting", "Sequences waiting in a worker", labels=["worker"]
        )
        for wid, view in sorted(self.fleet.workers.items()):
            s = view.state
            depth.add_metric([wid, s.model], view.queue_len)
            kv.add_metric([wid, "free"], s.kv_blocks_free)
            kv.add_metric([wid, "used"], s.kv_blocks_total - s.kv_blocks_free)
            running.add_metric([wid], s.running)
            waiting.add_metric([wid], s.waiting)
        yield from (depth, kv, running, waiting)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class GatewayMetrics:
    def __init__(self, fleet: Fleet, top_adapters: int = 20):
        self.registry = CollectorRegistry()
        r = self.registry
        self.adapters = AdapterLabeler(top_adapters)
        self.requests = Counter(
            "loragate_requests", "Finished requests", ["model", "adapter", "status"], registry=r
        )
        self.ttft = Histogram(
            "loragate_ttft_seconds", "Time to first token", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "loragate_itl_seconds",
            "Mean inter-token latency per request",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "loragate_request_duration_seconds",
            "End-to-end latency",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("loragate_prompt_tokens", "Prompt tokens", ["kind"], registry=r)
        self.completion_tokens = Counter(
            "loragate_completion_tokens", "Generated tokens", ["model"], registry=r
        )
        self.decisions = Counter("loragate_routing_decisions", "Routing decisions", ["outcome"], registry=r)
        self.adapter_tier = Counter(
            "loragate_routed_adapter_tier", "Adapter tier on the chosen worker", ["tier"], registry=r
        )
        self.prefix_tokens = Counter(
            "loragate_prefix_tokens", "Predicted vs actual cached prompt tokens", ["kind"], registry=r
        )
        self.rejected = Counter("loragate_rejected", "Refused requests", ["status"], registry=r)
        r.register(_FleetCollector(fleet))

    def finished(
        self,
        model: str,
        base: str,
        adapter: str | None,
        ttft_s: float,
        duration_s: float,
        itl_s: float | None,
        prompt: int,
        cached: int,
        completion: int,
    ) -> None:
        self.requests.labels(model=base, adapter=self.adapters.label(adapter), status="200").inc()
        self.ttft.labels(model=base).observe(ttft_s)
        self.duration.labels(model=base).observe(duration_s)
        if itl_s is not None:
            self.itl.labels(model=base).observe(itl_s)
        self.prompt_tokens.labels(kind="cached").inc(cached)
        self.prompt_tokens.labels(kind="computed").inc(max(0, prompt - cached))
        self.completion_tokens.labels(model=base).inc(completion)

    def failed(self, base: str, adapter: str | None, status: int) -> None:
        self.requests.labels(model=base, adapter=self.adapters.label(adapter), status=str(status)).inc()
        if status in (429, 503, 504):
            self.rejected.labels(status=str(status)).inc()
