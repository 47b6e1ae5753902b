"""compose.yaml describes the same stack `loragate up` runs, and every command in it parses with the
real CLI. No Docker engine runs here, so the file is checked with a YAML parser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.main import build_parser as gateway_parser
from worker.main import build_parser as worker_parser

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
