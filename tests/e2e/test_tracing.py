"""One trace per request, from the gateway through the Redis queue into the worker.

In-process: the gateway app (real uvicorn on 127.0.0.1) and the worker service (a thread) each have
their own tracer provider and in-memory exporter, as two processes would; the only link between them is
the `traceparent` in the queued message. Out-of-process: the real stack exports OTLP/HTTP to a small
receiver in the test, and spans of both services arrive under one trace id.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
import redis
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_app
from gateway.settings import GatewaySettings
from loragate import contracts
from loragate.messages import WorkerState
from loragate.tracing import make_provider
from tests.e2e.stack import Stack, free_port
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths
from worker.registry import AdapterRegistry
from worker.service import WorkerService

KEY = "sk-trace"


@pytest.fixture
def traced_stack(
    zoo: ZooPaths, redis_url: str
) -> Iterator[tuple[str, InMemorySpanExporter, InMemorySpanExporter]]:
    r = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
    worker_spans, gateway_spans = InMemorySpanExporter(), InMemorySpanExporter()
    provider = make_provider("loragate-worker", worker_spans)
    assert provider is not None
    registry = AdapterRegistry(r, "tiny")
    registry.publish_directory(zoo.root / "adapters" / "tiny")
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=128))
    service = WorkerService(engine, r, "tw1", "tiny", registry, tracer=provider.get_tracer("test"))
    worker = threading.Thread(target=service.run, daemon=True)
    worker.start()
    port = free_port()
    app = create_app(GatewaySettings(redis_url=redis_url, api_keys={KEY: "t"}), span_exporter=gateway_spans)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    try:
        yield url, gateway_spans, worker_spans
    finally:
        server.should_exit = True
        thread.join(10)
        service.drain()
        worker.join(10)
        r.close()


def test_one_trace_spans_gateway_queue_and_worker(
    traced_stack: tuple[str, InMemorySpanExporter, InMemorySpanExporter], redis_url: str
) -> None:
    url, gateway_spans, worker_spans = traced_stack
    body = {
        "model": "tiny:qv-r8",
        "prompt": "def main():",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert resp.status_code == 200
    time.sleep(0.3)
    gw = {s.name: s for s in gateway_spans.get_finished_spans()}
    server = next(s for s in gw.values() if s.name.startswith("POST /v1/completions") and s.parent is None)
    for child in ("auth", "tokenize", "route", "enqueue"):
        assert gw[child].parent is not None and gw[child].parent.span_id == server.context.span_id, child
    assert server.attributes is not None
    assert server.attributes["gen_ai.request.model"] == "tiny:qv-r8"
    assert server.attributes["gen_ai.usage.output_tokens"] == 6
    route = gw["route"].attributes or {}
    assert route["loragate.route.worker"] == "tw1" and "loragate.route.score.prefix" in route
    # A fresh worker has never loaded the adapter: it had to come from disk.
    assert route["loragate.route.adapter_tier"] == "disk"

    wk = {s.name: s for s in worker_spans.get_finished_spans()}
    gen = wk["text_completion tiny"]
    for name in ("queue wait", "text_completion tiny"):
        span = wk[name]
        assert span.context.trace_id == server.context.trace_id  # the same trace, across the queue
        assert span.parent is not None and span.parent.span_id == server.context.span_id
    for name in ("prefill", "decode"):
        assert wk[name].parent is not None and wk[name].parent.span_id == gen.context.span_id
    attrs = gen.attributes or {}
    assert attrs["gen_ai.usage.output_tokens"] == 6 and attrs["gen_ai.response.id"] == resp.json()["id"]
    assert attrs["loragate.ttft_s"] > 0 and attrs["loragate.itl_s"] > 0

    # Once the worker's heartbeat says the adapter is on its device, the next route span says so too.
    wait_until_resident(redis_url, "tw1", "tiny:qv-r8")
    gateway_spans.clear()
    resp = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert resp.status_code == 200
    time.sleep(0.3)
    route = next(s for s in gateway_spans.get_finished_spans() if s.name == "route").attributes or {}
    assert route["loragate.route.adapter_tier"] == "device"


def wait_until_resident(redis_url: str, worker_id: str, adapter: str, timeout: float = 10.0) -> None:
    """Until the worker's heartbeat lists `adapter` on its device, and the gateway's fleet view (refreshed
    every 0.5 s) has had time to read it."""
    r = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            raw = r.get(contracts.worker_state("tiny", worker_id))
            if raw is not None and adapter in WorkerState.from_json(raw).adapters_device:
                time.sleep(1.0)
                return
            time.sleep(0.1)
    finally:
        r.close()
    raise AssertionError(f"{adapter} never became resident on {worker_id}")


class _Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            msg = ExportTraceServiceRequest()
            msg.ParseFromString(body)
            self.received.append(msg)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_stack_exports_otlp_http_to_a_collector(zoo: ZooPaths, redis_server: str, tmp_path: Path) -> None:
    _Receiver.received = []
    receiver = HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    client = redis.Redis.from_url(redis_server, socket_timeout=10, socket_connect_timeout=10)
    client.flushall()
    client.close()
    stack = Stack(zoo, redis_server, tmp_path)
    stack.env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
    )
    try:
        stack.start_worker("ow1")
        stack.start_gateway()
        stack.wait_ready(workers=1)
        body = {"model": "tiny", "prompt": "import sys", "max_tokens": 4}
        resp = httpx.post(
            f"{stack.url}/v1/completions",
            json=body,
            headers={"Authorization": "Bearer sk-test-alice"},
            timeout=60,
        )
        assert resp.status_code == 200
        deadline = time.monotonic() + 20
        services: dict[str, set[bytes]] = {}
        while time.monotonic() < deadline:
            services = {}
            for msg in list(_Receiver.received):
                for rs in msg.resource_spans:
                    name = next(
                        a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                    )
                    for ss in rs.scope_spans:
                        services.setdefault(name, set()).update(s.trace_id for s in ss.spans)
            if {"loragate-gateway", "loragate-worker"} <= set(services) and (
                services["loragate-gateway"] & services["loragate-worker"]
            ):
                break
            time.sleep(0.2)
        assert services["loragate-gateway"] & services["loragate-worker"], services.keys()
    finally:
        stack.stop()
        receiver.shutdown()
        receiver.server_close()
