"""`loragate up`'s command line: what each form serves, and every flag mistake refused (exit 2, naming the
flag) before anything starts, including a stack file combined with flags it would silently override."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loragate import stack_sources
from loragate.stack_config import StackConfig, StackError, parse_stack
from loragate.up import _worker_args
from loragate.up_args import DEFAULT_AUTO, build_parser, stack_from_args


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")
    (tmp_path / "adapters").mkdir()
    return tmp_path


def _stack(*argv: str) -> StackConfig:
    return stack_from_args(build_parser().parse_args(list(argv)))


def test_default_serves_smollm2_with_its_adapters_and_tiny_as_autos_cheap_tier() -> None:
    stack = _stack("--workers", "3", "--device", "cpu", "--kv-cache-mb", "256")
    smollm2, tiny = stack.models
    assert (smollm2.name, smollm2.source, smollm2.workers, smollm2.device) == ("smollm2", "smollm2", 3, "cpu")
    assert smollm2.adapters == stack_sources.shipped_adapters("smollm2")
    assert smollm2.adapters is not None and smollm2.adapters.parent.name == "modelzoo"
    assert (tiny.name, tiny.workers, tiny.device, tiny.dtype) == ("tiny", 1, "cpu", None)
    assert smollm2.kv_cache_mb == tiny.kv_cache_mb == 256  # every worker's
    assert _stack().models[0].kv_cache_mb is None  # unset: the worker sizes its own
    assert stack.auto == DEFAULT_AUTO and stack.port == 8000
    assert stack_sources.prepare_commands(m.source for m in stack.models) == [
        ["models", "pull", "smollm2"],
        ["models", "make"],
    ]


def test_model_dir_serves_it_alone_named_after_the_directory(ckpt: Path) -> None:
    stack = _stack(
        "--model", str(ckpt / "my-model"), "--adapters", str(ckpt / "adapters"), "--dtype", "float16"
    )
    (model,) = stack.models
    assert (model.name, model.source, model.adapters) == (
        "my-model",
        str(ckpt / "my-model"),
        ckpt / "adapters",
    )
    assert (model.workers, model.device, model.dtype, model.kv_cache_mb) == (1, None, "float16", None)
    assert stack.auto == ({"model": "my-model"},)
    assert stack_sources.prepare_commands(m.source for m in stack.models) == []
    named = _stack("--model", str(ckpt / "my-model"), "--model-name", "mine", "--workers", "2")
    assert named.models[0].name == "mine" and named.models[0].workers == 2


def test_model_smollm2_is_pulled_and_served_alone() -> None:
    (model,) = _stack("--model", "smollm2").models
    assert model.name == "smollm2" and model.checkpoint == stack_sources.checkpoint_dir("smollm2")
    assert model.adapters == stack_sources.shipped_adapters("smollm2")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-c", "s.yaml", "--model", "x"], "--model: cannot be combined with -c/--config s.yaml"),
        (["--config", "s.yaml", "--workers", "2", "--port", "1"], "--workers, --port: cannot be combined"),
        (["-c", "s.yaml", "--device", "cpu"], "--device: cannot be combined with -c/--config"),
        (["--adapters", "d"], "--adapters: needs --model DIR"),
        (["--model-name", "x"], "--model-name: needs --model DIR"),
        (["--workers", "0"], "--workers: must be an integer ≥ 1, got 0"),
        (["--model", "MISSING", "--workers", "1"], "--model: "),
        (["--device", "tpu"], "--device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--dtype", "int8"], "--dtype: must be one of auto, float32, bfloat16, float16, got 'int8'"),
        (["--kv-cache-mb", "0"], "--kv-cache-mb: must be an integer ≥ 1 (MiB), got 0"),
        (["-c", "s.yaml", "--kv-cache-mb", "64"], "--kv-cache-mb: cannot be combined with -c/--config"),
        (["--port", "0"], "--port: must be an integer from 1 to 65535, got 0"),
        (["--model", "smollm2", "--model-name", "a/b"], "--model-name: 'a/b' is not a model name"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_flag_mistakes_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(StackError) as err:
        _stack(*argv)
    assert str(err.value).startswith(message), str(err.value)


def test_missing_checkpoint_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "no-config").mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "loragate.cli", "up", "--model", str(tmp_path / "no-config")],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == (
        f"loragate up: --model: {tmp_path / 'no-config'} has no config.json (not a Hugging Face checkpoint)"
    )


def test_up_names_models_where_models_pull_and_models_make_put_them() -> None:
    # stack_sources repeats these so that `up` imports neither (gguf, numpy; torch through the zoo).
    from worker.hub import pull
    from worker.modelzoo import make

    assert set(stack_sources.PULLED) == set(pull.PULLABLE)
    assert all(stack_sources.checkpoint_dir(name) == pull.model_dir(name) for name in stack_sources.PULLED)
    assert make.default_root().name == stack_sources.ZOO


def test_up_stays_light_it_never_imports_torch() -> None:
    code = (
        "import sys, loragate.up, loragate.up_args as a; a.stack_from_args(a.build_parser().parse_args([]));"
        "print(sorted(m for m in ('torch', 'transformers', 'worker.engine') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def test_each_models_device_dtype_and_kv_cache_reach_every_one_of_its_workers(ckpt: Path) -> None:
    raw = {
        "models": [
            {"name": "a", "path": "my-model", "workers": 2, "device": "cpu", "kv_cache_mb": 64},
            {"name": "b", "path": "my-model", "dtype": "float16"},
        ]
    }
    workers = _worker_args(parse_stack(raw, "s.yaml", ckpt), "x1")

    def placed(args: list[str]) -> dict[str, str]:
        return {f: args[args.index(f) + 1] for f in ("--device", "--dtype", "--kv-cache-mb") if f in args}

    assert {w: placed(args) for w, args in workers.items()} == {
        "a-0-x1": {"--device": "cpu", "--kv-cache-mb": "64"},
        "a-1-x1": {"--device": "cpu", "--kv-cache-mb": "64"},
        "b-2-x1": {"--dtype": "float16"},  # unset: the worker's own defaults
    }
