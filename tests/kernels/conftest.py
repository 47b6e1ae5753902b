"""Kernel-test plumbing: where and on what device the Triton tests (`test_*_triton.py`) run.

On a machine with a GPU they run here, on CUDA tensors, compiled. Without one they need the Triton
interpreter on CPU tensors, and `triton.jit` decides when a module is imported whether its kernels (and
triton.language's own jit'd helpers such as `tl.sum`) are compiled or interpreted, so
`TRITON_INTERPRET=1` must be set before triton is first imported. In a plain `pytest` run that has
already happened (test modules import peft and the kernels, which import triton), so the files are not
collected there; `test_triton_interpreter.py` runs them in child pytests with the variable set from the
start, each child a shard of them (`SHARD_ENV`).
To run them directly:

    TRITON_INTERPRET=1 pytest tests/kernels -k triton
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kernels.backend import BACKEND_ENV, triton_interpreting
from tests.kernels.kernel_testing import INTERPRETER_TESTS, SHARD_ENV


def triton_device() -> str:
    """Where the Triton tests put their tensors: CPU under the interpreter, else the GPU."""
    return "cpu" if triton_interpreting() else "cuda"


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if collection_path.match(INTERPRETER_TESTS) and not (triton_interpreting() or torch.cuda.is_available()):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With `SHARD_ENV` set to "i/n", keep every n-th collected test from the i-th (the rest deselected)."""
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return
    index, count = (int(part) for part in spec.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"{SHARD_ENV}={spec!r}: want i/n with 0 <= i < n")
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % count != index])
    items[:] = [item for k, item in enumerate(items) if k % count == index]


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> str:
    """The Triton tests' device, with the public kernels routed to Triton for the test."""
    monkeypatch.setenv(BACKEND_ENV, "triton")
    return triton_device()


@pytest.fixture(params=["torch", "native"])
def cpu_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A CPU kernel path under test: the torch one, or the native C++ one (`kernels.native`; the test
    fails if it cannot be built here)."""
    monkeypatch.setenv(BACKEND_ENV, request.param)
    return str(request.param)
