"""A stack file is checked whole before anything starts: each mistake is refused with a message naming the
file and the key path; the example in deploy/ is valid and is the stack plain `loragate up` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loragate import stack_sources
from loragate.stack_config import ModelSpec, StackError, load_stack, parse_stack, with_auto
from loragate.up_args import build_parser, stack_from_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """tmp_path with a checkpoint `ckpt/` (config.json) and adapters `adapters/{a,b}/`."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for name in ("a", "b"):
        (tmp_path / "adapters" / name).mkdir(parents=True)
        (tmp_path / "adapters" / name / "adapter_config.json").write_text("{}")
    return tmp_path


def _model(**extra: Any) -> dict[str, Any]:
    return {"path": "ckpt", "adapters": "adapters"} | extra


CASES = [
    pytest.param(["x"], "s.yaml: must be a mapping (key: value), got list", id="not a mapping"),
    pytest.param({"port": 8000}, "s.yaml: models: is required (a list of models to serve)", id="no models"),
    pytest.param({"models": []}, "s.yaml: models: must be a non-empty list of models", id="empty models"),
    pytest.param(
        {"models": [_model()], "prot": 1},
        "s.yaml: prot: unknown key (did you mean 'port'?)",
        id="unknown top key",
    ),
    pytest.param(
        {"models": [_model(worker=2)]},
        "s.yaml: models[0].worker: unknown key (did you mean 'workers'?)",
        id="unknown model key",
    ),
    pytest.param(
        {"models": ["ckpt"]},
        "s.yaml: models[0]: must be a mapping (key: value), got str",
        id="model not a mapping",
    ),
    pytest.param({"models": [{"name": "x"}]}, "s.yaml: models[0].path: is required", id="no path"),
    pytest.param(
        {"models": [_model(path="nope")]},
        "is not a directory (nor a model name: smollm2, tiny, small)",
        id="missing dir",
    ),
    pytest.param(
        {"models": [_model(path="empty")]},
        "empty has no config.json (not a Hugging Face checkpoint)",
        id="no config.json",
    ),
    pytest.param(
        {"models": [_model(), _model(name="b", workers=0)]},
        "s.yaml: models[1].workers: must be an integer ≥ 1, got 0",
        id="workers 0",
    ),
    pytest.param(
        {"models": [_model(workers="2")]},
        "s.yaml: models[0].workers: must be an integer ≥ 1, got '2'",
        id="workers text",
    ),
    pytest.param(
        {"models": [_model(workers=True)]},
        "s.yaml: models[0].workers: must be an integer ≥ 1, got True",
        id="workers bool",
    ),
    pytest.param(
        {"models": [_model(device="gpu")]},
        "s.yaml: models[0].device: must be auto, cpu, cuda or cuda:N, got 'gpu'",
        id="bad device",
    ),
    pytest.param(
        {"models": [_model(dtype="fp8")]},
        "s.yaml: models[0].dtype: must be one of auto, float32, bfloat16, float16, got 'fp8'",
        id="bad dtype",
    ),
    pytest.param(
        {"models": [_model(kv_cache_mb=0)]},
        "s.yaml: models[0].kv_cache_mb: must be an integer ≥ 1 (MiB), got 0",
        id="kv_cache_mb 0",
    ),
    pytest.param(
        {"models": [_model(kv_cache_mb="256MB")]},
        "s.yaml: models[0].kv_cache_mb: must be an integer ≥ 1 (MiB), got '256MB'",
        id="kv_cache_mb text",
    ),
    pytest.param(
        {"models": [_model(kv_cache_mb=True)]},
        "s.yaml: models[0].kv_cache_mb: must be an integer ≥ 1 (MiB), got True",
        id="kv_cache_mb bool",
    ),
    pytest.param(
        {"models": [_model(name="a:b")]},
        "s.yaml: models[0].name: 'a:b' is not a model name",
        id="name with colon",
    ),
    pytest.param(
        {"models": [_model(name="auto")]},
        "s.yaml: models[0].name: 'auto' is not a model name",
        id="name auto",
    ),
    pytest.param(
        {"models": [_model(), _model()]},
        "s.yaml: models[1].name: 'ckpt' is already the name of another model",
        id="duplicate name",
    ),
    pytest.param(
        {"models": [_model(adapters="nope")]}, "s.yaml: models[0].adapters: ", id="adapters missing"
    ),
    pytest.param(
        {"models": [_model(pin=["c"])]},
        "s.yaml: models[0].pin[0]: no adapter 'c' in ",
        id="pin unknown adapter",
    ),
    pytest.param(
        {"models": [{"path": "ckpt", "pin": ["a"]}]},
        "s.yaml: models[0].pin[0]: no adapter 'a' in None",
        id="pin without adapters",
    ),
    pytest.param(
        {"models": [_model(pin="a")]},
        "s.yaml: models[0].pin: must be a list of adapter names",
        id="pin not a list",
    ),
    pytest.param(
        {"models": [_model()], "api_keys": ["k"]},
        "s.yaml: api_keys: must be a mapping of API key to tenant",
        id="api_keys list",
    ),
    pytest.param(
        {"models": [_model()], "api_keys": {"k": ""}},
        "s.yaml: api_keys: must be a mapping of API key to tenant",
        id="empty tenant",
    ),
    pytest.param(
        {"models": [_model()], "admin_token": 5},
        "s.yaml: admin_token: must be a non-empty string",
        id="admin token number",
    ),
    pytest.param(
        {"models": [_model()], "port": 70000},
        "s.yaml: port: must be an integer from 1 to 65535, got 70000",
        id="port too big",
    ),
    pytest.param(
        {"models": [_model()], "host": ""}, "s.yaml: host: must be a host name or address", id="host empty"
    ),
    pytest.param(
        {"models": [_model()], "auto": "ckpt"}, "s.yaml: auto: must be a list, got str", id="auto not a list"
    ),
    pytest.param(
        {"models": [_model()], "auto": []}, "s.yaml: auto: needs at least one rung", id="auto no rungs"
    ),
    pytest.param(
        {"models": [_model()], "auto": [{"model": "big"}]},
        "s.yaml: auto[0].model: 'big' is not a model of this stack (ckpt)",
        id="auto unknown model",
    ),
    pytest.param(
        {"models": [_model()], "auto": [{"model": "ckpt", "max_score": 0.5}]},
        "s.yaml: auto[0].max_score: the last rung takes every higher score",
        id="auto last max_score",
    ),
    pytest.param(
        {
            "models": [_model(), _model(name="b")],
            "auto": [{"max_score": 0.5, "model": "ckpt"}, {"max_score": 0.2, "model": "b"}, {"model": "b"}],
        },
        "s.yaml: auto[1].max_score: must be above the previous rung's (0.5)",
        id="auto order",
    ),
    pytest.param(
        {"models": [_model()], "api_keys": []},
        "s.yaml: api_keys: must be a mapping of API key to tenant",
        id="api_keys empty list",
    ),
    pytest.param(
        {"models": [_model()], "api_keys": None},
        "s.yaml: api_keys: must be a mapping of API key to tenant",
        id="api_keys null",
    ),
    pytest.param(
        {"models": [_model(pin=["a", "a"])]},
        "s.yaml: models[0].pin: names an adapter more than once",
        id="pin twice",
    ),
    pytest.param(
        {"models": [_model()], "auto": [{"modle": "ckpt"}]},
        "s.yaml: auto[0].modle: unknown key",
        id="auto rung key",
    ),
]


@pytest.mark.parametrize(("raw", "message"), CASES)
def test_each_mistake_is_refused_naming_the_file_and_key(files: Path, raw: Any, message: str) -> None:
    with pytest.raises(StackError) as err:
        parse_stack(raw, "s.yaml", files)
    assert message in str(err.value)


def test_a_pulled_model_whose_shipped_adapters_are_missing_is_refused(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack_sources, "shipped_adapters", lambda source: files / "gone")
    with pytest.raises(StackError) as err:
        parse_stack({"models": [{"path": "smollm2"}]}, "s.yaml", files)
    gone = files / "gone"
    assert str(err.value) == f"s.yaml: models[0].path: smollm2's shipped adapters are missing ({gone})"


def test_the_shipped_smollm2_adapters_are_in_the_repository() -> None:
    shipped = stack_sources.shipped_adapters("smollm2")
    assert shipped is not None and len(list(shipped.glob("*/adapter_config.json"))) >= 6, shipped


def test_a_valid_file_gives_the_stack_with_paths_relative_to_the_file(files: Path) -> None:
    path = files / "stack.yaml"
    raw = {
        "models": [
            _model(name="mine", workers=3, device="cuda:1", dtype="bfloat16", kv_cache_mb=256, pin=["b"]),
            {"path": "tiny"},
        ],
        "api_keys": {"sk-a": "team-a"},
        "admin_token": "adm",
        "port": 9001,
        "auto": [{"max_score": 0.3, "model": "tiny"}, {"model": "mine"}],
    }
    path.write_text(yaml.safe_dump(raw))
    stack = load_stack(path)
    mine = ModelSpec("mine", str(files / "ckpt"), files / "adapters", 3, "cuda:1", "bfloat16", ("b",), 256)
    tiny = ModelSpec("tiny", "tiny", stack_sources.shipped_adapters("tiny"))
    assert stack.models == (mine, tiny) and stack.workers == 4
    assert stack.api_keys == {"sk-a": "team-a"} and stack.admin_token == "adm"
    assert (stack.host, stack.port) == ("127.0.0.1", 9001)
    assert stack.auto == ({"max_score": 0.3, "model": "tiny"}, {"model": "mine"})


def test_without_auto_rungs_auto_is_the_first_model(files: Path) -> None:
    stack = parse_stack({"models": [_model()]}, "s.yaml", files)
    assert stack.auto == ({"model": "ckpt"},) and stack.models[0].name == "ckpt"  # the directory's name


def test_unreadable_and_invalid_yaml_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="cannot read the stack file"):
        load_stack(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("models: [\n")
    with pytest.raises(StackError, match=r"bad\.yaml: not valid YAML"):
        load_stack(tmp_path / "bad.yaml")


def test_the_example_file_is_valid_and_is_the_default_stack() -> None:
    example = load_stack(ROOT / "deploy" / "stack.example.yaml")
    assert example == stack_from_args(build_parser().parse_args([]))
    assert [m.name for m in example.models] == ["smollm2", "tiny"]
    assert example.auto == ({"max_score": 0.4, "model": "tiny"}, {"model": "smollm2"})


def test_with_auto_sets_the_rungs_and_drops_their_old_name() -> None:
    rungs = [{"max_score": 0.5, "model": "tiny"}, {"model": "big"}]
    old = {"default_profile": "p", "aliases": {"auto": {"tiers": [{"model": "x"}], "profile": "p"}}}
    assert with_auto(old, rungs) == {
        "default_profile": "p",
        "aliases": {"auto": {"profile": "p", "rungs": rungs}},
    }
    assert old["aliases"]["auto"] == {"tiers": [{"model": "x"}], "profile": "p"}  # a copy, not an edit
