"""`--device` / `--dtype`: what each spec resolves to, and the clear errors for what cannot run.

The CUDA cases on a machine without a GPU fake only torch's answers to "is CUDA available / how many
devices / is bf16 supported"; everything else is the real resolver.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import torch

from loadtest import bench_engine
from worker.device import host_to_device, resolve_device, resolve_dtype
from worker.main import build_parser, main


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def signal_handlers() -> Iterator[None]:
    """`loragate worker`'s main installs stop-signal handlers first thing: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cpu_without_a_gpu(no_gpu: None) -> None:
    assert resolve_device("auto") == "cpu"
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_auto_is_the_gpu_when_there_is_one(two_gpus: None) -> None:
    assert resolve_device("auto") == "cuda"


@pytest.mark.parametrize(
    ("spec", "device"), [("cpu", "cpu"), ("CPU", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")]
)
def test_explicit_devices(two_gpus: None, spec: str, device: str) -> None:
    assert resolve_device(spec) == device


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tpu", r"'tpu' is not one of auto, cpu, cuda, cuda:N"),
        ("cuda:x", r"is not one of"),
        ("cuda:2", r"there are 2 CUDA device\(s\), cuda:0 to cuda:1"),
    ],
)
def test_bad_devices_say_what_is_allowed(two_gpus: None, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_device(spec)


def test_cuda_without_a_gpu_says_so(no_gpu: None) -> None:
    with pytest.raises(ValueError, match=r"CUDA is not available.*use cpu or auto"):
        resolve_device("cuda:0")


@pytest.mark.parametrize(
    ("spec", "device", "dtype"),
    [
        ("float32", "cpu", torch.float32),
        ("bfloat16", "cpu", torch.bfloat16),
        ("float16", "cpu", torch.float16),  # allowed on CPU (see worker.device)
        ("float32", "cuda:1", torch.float32),
    ],
)
def test_explicit_dtypes(spec: str, device: str, dtype: torch.dtype) -> None:
    assert resolve_dtype(spec, device) == dtype


@pytest.mark.parametrize(("bf16", "dtype"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_a_gpu_is_bf16_where_supported(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", "cuda") == dtype
    if not bf16:
        with pytest.raises(ValueError, match="bfloat16 is not supported on cuda"):
            resolve_dtype("bfloat16", "cuda")


def test_bad_dtype_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="'fp8' is not one of auto, float32, bfloat16, float16"):
        resolve_dtype("fp8", "cpu")


def test_host_to_device_keeps_values_and_dtype() -> None:
    t = host_to_device([3, 1, 2], torch.int64, "cpu")
    assert t.tolist() == [3, 1, 2] and t.dtype == torch.int64 and t.device.type == "cpu"


def test_worker_flags_default_to_auto() -> None:
    args = build_parser().parse_args(["--model", "m"])
    assert (args.device, args.dtype) == ("auto", "auto")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "tpu"], "--device: device 'tpu' is not one of"),
        (["--dtype", "fp8"], "--dtype: dtype 'fp8' is not one of"),
    ],
)
def test_worker_and_bench_reject_bad_flags_naming_them(
    no_gpu: None, signal_handlers: None, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    for run in (lambda: main(["--model", "m", *flags]), lambda: bench_engine.main(flags)):
        with pytest.raises(SystemExit) as exc:
            run()
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
