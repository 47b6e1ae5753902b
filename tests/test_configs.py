"""Every config the project ships loads with the real loader, and a bad one is a clear error.

Shipped configs: the files under deploy/ (each mounted by compose.yaml into the service that reads it, or
a stack file for `loragate up -c`), and every YAML/JSON example in the README, docs/ and the settings
module's docstring that is a gateway config or a stack file. A new file under deploy/ must be added to
CONFIG_READERS or STACK_FILES, so none ships untested.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

import gateway.settings
from gateway.settings import ConfigError, GatewaySettings
from loragate.stack_config import StackError, load_stack

ROOT = Path(__file__).resolve().parents[1]
GATEWAY_KEYS = {f.name for f in fields(GatewaySettings)}

# deploy/ file -> the compose service that mounts it
CONFIG_READERS = {
    "gateway.yaml": "gateway",
    "otel-collector.yaml": "otel-collector",
    "prometheus.yml": "prometheus",
}
STACK_FILES = ("stack.example.yaml",)  # read by `loragate up -c` (tests/loragate/test_stack_config.py)


def _mounts(compose: dict[str, Any]) -> dict[str, str]:
    """Repository file -> the service that mounts it (from the services' `./path:/container/path` volumes)."""
    out = {}
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                out[source.removeprefix("./")] = name
    return out


def _doc_examples() -> list[tuple[str, str, str]]:
    """(where, language, text) of each fenced YAML/JSON block in the README, docs/ and gateway/settings.py."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), Path(gateway.settings.__file__)]
    found = []
    for source in sources:
        text = source.read_text()
        for match in re.finditer(r"```(yaml|yml|json)\n(.*?)```", text, re.S):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{source.relative_to(ROOT)}:{line}", match.group(1), match.group(2)))
    return found


def test_every_file_under_deploy_is_mounted_by_the_service_that_reads_it() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    # (deploy/kubernetes, a directory of manifests, is checked by tests/deploy/test_kubernetes.py.)
    shipped = {p.name for p in (ROOT / "deploy").iterdir() if p.is_file()}
    assert shipped == {*CONFIG_READERS, *STACK_FILES}, "a new config file needs a loader check here"
    assert _mounts(compose) == {f"deploy/{name}": service for name, service in CONFIG_READERS.items()}


def test_the_compose_gateway_config_loads_with_the_real_loader() -> None:
    # The file compose mounts at the gateway's --config path; it used to fail on `max_queue_per_worker`.
    settings = GatewaySettings.load("redis://redis:6379/0", ROOT / "deploy" / "gateway.yaml")
    assert settings.api_keys == {"sk-dev-compose": "dev"}
    assert settings.adapter_roots == (Path("/models").resolve(),)


def test_third_party_configs_parse() -> None:
    # Read by images we do not run here; their content is checked in tests/test_compose.py.
    for name in ("otel-collector.yaml", "prometheus.yml"):
        assert isinstance(yaml.safe_load((ROOT / "deploy" / name).read_text()), dict), name


def test_every_gateway_config_example_in_the_docs_loads(tmp_path: Path) -> None:
    examples = [
        (where, lang, text)
        for where, lang, text in _doc_examples()
        if isinstance(data := (json.loads(text) if lang == "json" else yaml.safe_load(text)), dict)
        and GATEWAY_KEYS & set(data)
        and "models" not in data  # a stack file (below)
    ]
    assert any(where.startswith("gateway/settings.py") for where, _, _ in examples)
    for i, (where, lang, text) in enumerate(examples):
        path = tmp_path / f"example-{i}.{lang}"
        path.write_text(text)
        try:
            GatewaySettings.load("redis://127.0.0.1:6379/0", path)
        except ConfigError as err:
            pytest.fail(f"the example at {where} does not load: {err}")


def test_every_stack_file_shipped_or_in_the_docs_loads(tmp_path: Path) -> None:
    examples = [(f"deploy/{name}", (ROOT / "deploy" / name).read_text()) for name in STACK_FILES]
    examples += [
        (where, text)
        for where, lang, text in _doc_examples()
        if lang != "json" and isinstance(data := yaml.safe_load(text), dict) and "models" in data
    ]
    for i, (where, text) in enumerate(examples):
        path = tmp_path / f"stack-{i}.yaml"
        path.write_text(text)
        try:
            load_stack(path)
        except StackError as err:
            pytest.fail(f"the stack file at {where} does not load: {err}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("request_timeout: 5\n", "unknown key 'request_timeout' (did you mean 'request_timeout_s'?)"),
        ("api_key: {sk-1: t}\n", "unknown key 'api_key' (did you mean 'api_keys'?)"),
        ("max_queue_per_worker: 256\n", "unknown key 'max_queue_per_worker'"),
        ("redis_url: redis://x\n", "key 'redis_url' cannot be set in a config file"),
        ("request_timeout_s: ten\n", "key 'request_timeout_s' must be a number, got 'ten'"),
        ("max_body_bytes: 1.5\n", "key 'max_body_bytes' must be an integer"),
        ("api_keys: [sk-1]\n", "key 'api_keys' must be a mapping"),
        ("adapter_roots: /models\n", "key 'adapter_roots' must be a list"),
        ("- api_keys\n", "expected a mapping of settings"),
        ("api_keys: {a: [\n", "not valid YAML"),
        ("admission_models: {tiny: {max_queue: 5}}\n", "admission_models.tiny.max_queue: unknown key"),
        ("admission_tenants: {bob: {wait_bound_s: -1}}\n", "admission_tenants.bob.wait_bound_s"),
    ],
)
def test_a_bad_config_is_an_error_naming_the_file_and_the_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        GatewaySettings.load("redis://127.0.0.1:6379/0", path)
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value)


def test_a_bad_json_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text('{"api_keys": {"sk-1": "t"}, "admin_tokne": "x"}')
    with pytest.raises(ConfigError, match=r"unknown key 'admin_tokne' \(did you mean 'admin_token'\?\)"):
        GatewaySettings.load("redis://127.0.0.1:6379/0", path)


def test_empty_values_mean_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("api_keys:\nadapter_roots:\nadmin_token:\n")
    settings = GatewaySettings.load("redis://127.0.0.1:6379/0", path)
    assert settings.api_keys == {} and settings.adapter_roots == () and settings.admin_token is None


def test_the_gateway_cli_reports_a_bad_config_and_exits_2_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("api_keys: {sk-1: t}\nmax_queue_per_worker: 256\nrequest_timout_s: 5\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "loragate.cli",
            "gateway",
            "--config",
            str(path),
            "--redis",
            "redis://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert f"loragate gateway: {path}: unknown key 'max_queue_per_worker'" in run.stderr
    assert "unknown key 'request_timout_s' (did you mean 'request_timeout_s'?)" in run.stderr


def test_ci_runs_the_suite_with_stdin_closed_and_sigint_ignored() -> None:
    # .ci/run is the README's test command; it must prove the suite passes (and never hangs) in the
    # setting of a service manager or a background job.
    assert "exec ./scripts/test" in (ROOT / ".ci" / "run").read_text()
    script = (ROOT / "scripts" / "test").read_text()
    assert "trap '' INT" in script
    assert re.search(r"^python3 -m pytest .*</dev/null$", script, re.M)
