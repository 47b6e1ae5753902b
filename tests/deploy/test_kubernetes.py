"""deploy/kubernetes renders, with `kubectl kustomize`, into manifests a cluster accepts and that run the
fleet as designed.

Each overlay's render is checked against the Kubernetes API schemas (`kubernetes_validate`, strict: an
unknown or misspelt field is an error); KEDA's kinds, which those schemas lack, against the fields KEDA
documents. Then the invariants: what the gateway and the workers run (parsed with the real CLIs), their
probes, resources, drain time and metrics annotations, how the ScaledObjects find their workers and
their Redis, which overlay asks for GPUs, and that no real secret ships.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from gateway import openapi
from gateway.main import build_parser as gateway_parser
from gateway.settings import GatewaySettings
from loragate import contracts
from loragate.cli import build_parser as cli_parser

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.31"  # the oldest Kubernetes these manifests are checked against
CRD_KINDS = {"ScaledObject", "TriggerAuthentication"}  # checked by hand below
GATEWAY_COMMAND = "loragate gateway --host 0.0.0.0 --port 8000 --config /etc/loragate/gateway.yaml"

Obj = dict[str, Any]


def _render(path: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: `kubectl kustomize` renders the manifests under test")
    argv = [kubectl, "kustomize", str(path)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)}:\n{run.stderr}"
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc is not None]


@pytest.fixture(scope="module")
def renders() -> dict[str, list[Obj]]:
    return {name: _render(KUBERNETES / "overlays" / name) for name in OVERLAYS}


def _of(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def _named(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in _of(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"one {kind} {name!r} expected, found {len(found)}"
    return found[0]


def _component(objs: list[Obj], component: str) -> list[Obj]:
    """The Deployments of one component (gateway, worker)."""
    return [
        d
        for d in _of(objs, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]


def _gateway(objs: list[Obj]) -> Obj:
    (gateway,) = _component(objs, "gateway")
    return gateway


def _containers(workload: Obj) -> list[Obj]:
    """Init containers, then containers."""
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _argv(container: Obj) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _option(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def _selects(selector: dict[str, str], workload: Obj) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def _gateway_config(objs: list[Obj]) -> dict[str, Any]:
    """The gateway.yaml the gateway's ConfigMap holds."""
    (config,) = [c for c in _of(objs, "ConfigMap") if "gateway.yaml" in c.get("data", {})]
    data: dict[str, Any] = yaml.safe_load(config["data"]["gateway.yaml"])
    return data


def _secret_refs(objs: list[Obj]) -> set[tuple[str, str]]:
    """(Secret, key) that a container's environment, a volume or a TriggerAuthentication reads."""
    refs = set()
    for workload in [*_of(objs, "Deployment"), *_of(objs, "StatefulSet")]:
        for c in _containers(workload):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add((ref["name"], ref["key"]))
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in volume:
                items = volume["secret"].get("items", [])
                refs |= {(volume["secret"]["secretName"], i["key"]) for i in items}
    for auth in _of(objs, "TriggerAuthentication"):
        refs |= {(t["name"], t["key"]) for t in auth["spec"]["secretTargetRef"]}
    return refs


# -- schemas -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_built_in_object_is_valid_for_the_kubernetes_api(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objs = renders[overlay]
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "ScaledObject"} <= {
        o["kind"] for o in objs
    }
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{overlay}: {obj['kind']} has no Kubernetes schema: check it as CRD_KINDS are")


SCALED_OBJECT_SPEC = {
    "scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "idleReplicaCount",
    "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers",
}  # fmt: skip
TRIGGER_FIELDS = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
# keda.sh/docs/latest/scalers/redis-streams: the redis-streams trigger's metadata
REDIS_STREAMS_METADATA = {
    "address", "host", "port", "addressFromEnv", "hostFromEnv", "portFromEnv", "usernameFromEnv",
    "passwordFromEnv", "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
    "activationLagCount", "enableTLS", "unsafeSsl", "databaseIndex",
}  # fmt: skip
# keda.sh/docs/latest/scalers/metrics-api: the metrics-api trigger's metadata (bearer auth: KEDA 2.13+)
METRICS_API_METADATA = {
    "url", "format", "valueLocation", "targetValue", "activationTargetValue", "unsafeSsl", "authMode",
}  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_objects_have_the_fields_keda_requires(renders: dict[str, list[Obj]], overlay: str) -> None:
    objs = renders[overlay]
    for so in _of(objs, "ScaledObject"):
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert set(spec) <= SCALED_OBJECT_SPEC, set(spec) - SCALED_OBJECT_SPEC
        assert spec["scaleTargetRef"]["name"] and spec["triggers"]
        assert 0 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            assert set(trigger) <= TRIGGER_FIELDS and trigger["type"] in {"redis-streams", "metrics-api"}
            metadata = trigger["metadata"]
            # The CRD's metadata is a map of strings: `streamLength: 8` would be refused by the API server.
            assert all(isinstance(v, str) for v in metadata.values()), metadata
            if trigger["type"] == "redis-streams":
                assert set(metadata) <= REDIS_STREAMS_METADATA, set(metadata) - REDIS_STREAMS_METADATA
                assert metadata["stream"]
                assert len({"address", "addressFromEnv", "host", "hostFromEnv"} & set(metadata)) == 1
                assert "consumerGroup" not in metadata  # with a group KEDA counts pending entries, not XLEN
                int(metadata["streamLength"])
            else:
                assert set(metadata) <= METRICS_API_METADATA, set(metadata) - METRICS_API_METADATA
                assert metadata["url"].startswith("http") and metadata["valueLocation"]
                float(metadata["targetValue"])
                if metadata.get("authMode") == "bearer":  # the token comes from a TriggerAuthentication
                    auth = _named(objs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
                    assert "token" in {t["parameter"] for t in auth["spec"]["secretTargetRef"]}
            if "authenticationRef" in trigger:
                _named(objs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    for auth in _of(objs, "TriggerAuthentication"):
        assert auth["apiVersion"] == "keda.sh/v1alpha1" and auth["spec"]["secretTargetRef"]
        for target in auth["spec"]["secretTargetRef"]:
            assert set(target) == {"parameter", "name", "key"}
            assert target["parameter"] in {"password", "username", "host", "port", "address", "tls", "token"}


# -- the gateway -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_runs_replicated_with_the_compose_command(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    gateway = _gateway(renders[overlay])
    assert gateway["spec"]["replicas"] >= 2
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    argv = _argv(container)
    assert " ".join(argv) == GATEWAY_COMMAND
    gateway_parser().parse_args(argv[2:])  # the real CLI takes it
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(_option(argv, "--config")).parent) in mounts
    env = {e["name"] for e in container["env"]}
    assert {"REDIS_URL", "LORAGATE_ADMIN_TOKEN", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_is_ready_while_redis_answers_with_a_worker_or_without(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """/health is 503 while no worker runs. A gateway must still be Ready then (the Service routes only to
    Ready pods), to queue requests on the model's stream: the backlog that makes KEDA start a worker. So
    readiness is `/ready` (Redis answers; tests/gateway/test_scaling_api.py), a route the gateway serves."""
    (container,) = _gateway(renders[overlay])["spec"]["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [8000]
    http = container["readinessProbe"]["httpGet"]
    assert http["path"] == "/ready" and http["port"] in ("http", 8000)
    assert "/ready" in openapi.document([])["paths"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_is_live_on_a_path_that_does_not_flap(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    # /health is 503 while no worker runs (scaled to zero): liveness there would restart every gateway.
    (container,) = _gateway(renders[overlay])["spec"]["template"]["spec"]["containers"]
    for probe in ("livenessProbe", "startupProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/metrics" and http["port"] in ("http", 8000), probe


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_service_selects_the_gateway_pods(renders: dict[str, list[Obj]], overlay: str) -> None:
    objs = renders[overlay]
    service = _named(objs, "Service", "gateway")
    assert _selects(service["spec"]["selector"], _gateway(objs))
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8000, "http")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_disruption_budget_keeps_one_gateway(renders: dict[str, list[Obj]], overlay: str) -> None:
    objs, gateway = renders[overlay], _gateway(renders[overlay])
    budgets = [
        p for p in _of(objs, "PodDisruptionBudget") if _selects(p["spec"]["selector"]["matchLabels"], gateway)
    ]
    assert len(budgets) == 1 and budgets[0]["spec"]["minAvailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_config_the_pod_assembles_loads_with_the_real_loader(
    renders: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    """The init container `config` writes the ConfigMap's gateway.yaml plus the Secret's api_keys.yaml
    where the gateway reads its --config. Its paths are those volumes' mounts; its script, run here on the
    rendered ConfigMap and Secret (an example keys file where the overlay ships no Secret), writes a
    config the real loader takes."""
    objs = renders[overlay]
    gateway = _gateway(objs)
    (init,) = [c for c in _containers(gateway) if c["name"] == "config"]
    (main,) = gateway["spec"]["template"]["spec"]["containers"]
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in init["volumeMounts"]}
    template, keys, out = (Path(a) for a in init["args"])
    config_map = _named(objs, "ConfigMap", mounted[str(template.parent)]["configMap"]["name"])
    assert template.name in config_map["data"]
    assert [i["path"] for i in mounted[str(keys.parent)]["secret"]["items"]] == [keys.name]
    assert "emptyDir" in mounted[str(out.parent)] and str(out) == _option(_argv(main), "--config")

    secrets = _of(objs, "Secret")
    keys_text = base64.b64decode(secrets[0]["data"][keys.name]).decode() if secrets else "sk-1: tenant-a\n"
    paths = [tmp_path / "template.yaml", tmp_path / "keys.yaml", tmp_path / "gateway.yaml"]
    paths[0].write_text(yaml.safe_dump(_gateway_config(objs)))
    paths[1].write_text(keys_text)
    assert init["command"][:2] == ["python3", "-c"]
    argv = [sys.executable, "-c", init["command"][2], *map(str, paths)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    settings = GatewaySettings.load("redis://redis:6379/0", paths[2])
    assert settings.api_keys == yaml.safe_load(keys_text)
    assert settings.model_queue_max == 256


# -- the workers -------------------------------------------------------------------------------------


def _workers(objs: list[Obj]) -> Iterator[tuple[str, Obj, list[str]]]:
    """(model, Deployment, worker argv) of each worker Deployment; at least one."""
    workers = _component(objs, "worker")
    assert workers
    for deployment in workers:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        yield deployment["metadata"]["labels"]["loragate.dev/model"], deployment, _argv(container)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_worker_serves_the_model_its_label_names(renders: dict[str, list[Obj]], overlay: str) -> None:
    from worker.main import build_parser as worker_parser  # imports torch: only here

    objs = renders[overlay]
    pulled_by_gateway = {
        _argv(c)[3] for c in _containers(_gateway(objs)) if _argv(c)[:3] == ["loragate", "models", "pull"]
    }
    for model, deployment, argv in _workers(objs):
        assert deployment["metadata"]["name"] == f"worker-{model}"
        assert deployment["spec"]["template"]["metadata"]["labels"]["loragate.dev/model"] == model
        assert argv[:2] == ["loragate", "worker"]
        args = worker_parser().parse_args(argv[2:])
        assert args.model_name == model and args.metrics_port == 9100
        # The model directory is what its init container pulls: $LORAGATE_CACHE/models/<model>.
        (pull,) = deployment["spec"]["template"]["spec"]["initContainers"]
        cli_parser().parse_args(_argv(pull)[1:])
        assert _argv(pull)[1:4] == ["models", "pull", model]
        cache = {e["name"]: e.get("value") for e in pull["env"]}["LORAGATE_CACHE"]
        assert args.model == f"{cache}/models/{model}"
        # The gateway tokenizes with the tokenizer in the directory the workers announce.
        assert model in pulled_by_gateway


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_worker_has_time_to_drain_before_it_is_killed(renders: dict[str, list[Obj]], overlay: str) -> None:
    # SIGTERM drains: running requests finish (no drain timeout), for up to the gateway's request
    # timeout; the grace period covers that.
    objs = renders[overlay]
    drain_s = _gateway_config(objs)["request_timeout_s"]
    for _, deployment, _ in _workers(objs):
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_s


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gpu_overlay_gives_workers_a_gpu(renders: dict[str, list[Obj]], overlay: str) -> None:
    for _, deployment, argv in _workers(renders[overlay]):
        resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
        gpus = {k: r.get("nvidia.com/gpu") for k, r in resources.items()}
        tolerations = deployment["spec"]["template"]["spec"].get("tolerations", [])
        if overlay == "gpu":
            assert gpus == {"requests": 1, "limits": 1} and _option(argv, "--device") == "cuda"
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
        else:
            assert gpus == {"requests": None, "limits": None} and _option(argv, "--device") == "cpu"
            # A CPU worker's math threads fit its CPU limit (torch would start one per node core).
            threads = _option(argv, "--threads")
            assert threads is not None and int(threads) <= float(resources["limits"]["cpu"])


# -- autoscaling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_scaled_object_scales_its_models_workers_on_the_models_shared_stream(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objs = renders[overlay]
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in _of(objs, "ScaledObject")}
    assert set(scaled) == {d["metadata"]["name"] for _, d, _ in _workers(objs)}, "one per worker Deployment"
    for model, deployment, _ in _workers(objs):
        so = scaled[deployment["metadata"]["name"]]
        assert so["spec"]["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        assert so["spec"]["minReplicaCount"] == 0  # scale to zero: requests wait on the stream
        triggers = {t["type"]: t for t in so["spec"]["triggers"]}
        assert set(triggers) == {"redis-streams", "metrics-api"}
        backlog = triggers["redis-streams"]
        assert backlog["metadata"]["stream"] == contracts.model_queue(model)
        assert backlog["metadata"]["activationLagCount"] == "0"  # one waiting request starts a worker
        # KEDA reads `addressFromEnv` from the target's first container: it must be there, as host:port.
        env = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert backlog["metadata"]["addressFromEnv"] in env
        # The demand: the gateway Service of this render (KEDA runs in its own namespace: a full name),
        # on the model's demand route, read where the gateway puts the sum.
        demand = triggers["metrics-api"]["metadata"]
        url = urlsplit(demand["url"])
        service = _named(objs, "Service", url.hostname.split(".")[0] if url.hostname else "")
        namespace = so["metadata"]["namespace"]
        assert url.hostname == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
        assert url.port in {p["port"] for p in service["spec"]["ports"]}
        assert _selects(service["spec"]["selector"], _gateway(objs))
        assert url.path == f"/admin/models/{model}/demand" and demand["valueLocation"] == "demand"
        assert demand["activationTargetValue"] == "0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_key_read_is_shipped_or_documented(renders: dict[str, list[Obj]], overlay: str) -> None:
    objs = renders[overlay]
    refs = _secret_refs(objs)
    assert {name for name, _ in refs} == {"loragate"}
    secrets = _of(objs, "Secret")
    if secrets:
        (secret,) = secrets
        assert {key for _, key in refs} <= set(secret["data"])
    else:  # the user creates it: the doc's command must give every key
        doc = (ROOT / "docs" / "KUBERNETES.md").read_text()
        for _, key in refs:
            assert f"--from-literal={key}=" in doc or f"--from-file={key}=" in doc, key


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_map_references_resolve(renders: dict[str, list[Obj]], overlay: str) -> None:
    objs = renders[overlay]
    maps = {c["metadata"]["name"]: c.get("data", {}) for c in _of(objs, "ConfigMap")}
    for workload in _of(objs, "Deployment"):
        for c in _containers(workload):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in maps[ref["name"]], (workload["metadata"]["name"], ref)
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps


# -- operations --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_resource_requests_and_limits(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    for workload in [*_of(renders[overlay], "Deployment"), *_of(renders[overlay], "StatefulSet")]:
        for c in _containers(workload):
            resources, where = c.get("resources", {}), f"{workload['metadata']['name']}/{c['name']}"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{where}: {kind}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_and_worker_pods_are_annotated_for_prometheus(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objs = renders[overlay]
    for deployment in [_gateway(objs), *(d for _, d, _ in _workers(objs))]:
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        ports = {p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert int(annotations["prometheus.io/port"]) in ports


def test_the_base_ships_no_secret_and_the_dev_secret_is_a_placeholder(renders: dict[str, list[Obj]]) -> None:
    assert _of(_render(KUBERNETES / "base"), "Secret") == []
    for overlay, objs in renders.items():
        for secret in _of(objs, "Secret"):
            data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
            assert data["LORAGATE_ADMIN_TOKEN"] == "change-me", overlay
            assert all("change-me" in key for key in yaml.safe_load(data["api_keys.yaml"])), overlay
            # Only a Redis inside the namespace, which the same overlay runs.
            _named(objs, "StatefulSet", "redis")
            assert data["REDIS_URL"] == "redis://redis:6379/0" and data["REDIS_ADDRESS"] == "redis:6379"
