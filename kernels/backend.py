"""Which implementation runs a kernel call: the Triton kernels for CUDA tensors; on a CPU the native C++
kernels (`kernels.native`) where one exists and it builds here, else the torch paths.

`LORAGATE_KERNEL_BACKEND` overrides the choice: `torch` forces the torch paths (on any device), `native`
forces the C++ kernels where one exists (an error if they cannot be built) and `triton` forces the Triton
kernels. Triton on CPU tensors only works under the Triton interpreter
(`TRITON_INTERPRET=1` set before the `kernels.*_triton` modules are imported), which is how the tests
prove the kernels on a machine without a GPU. Nothing here imports triton, so the CPU engine runs
without it installed; the public functions import the Triton modules only when they dispatch to them.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

BACKEND_ENV = "LORAGATE_KERNEL_BACKEND"
BACKENDS = ("auto", "torch", "native", "triton")


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend_choice() -> str:
    """`LORAGATE_KERNEL_BACKEND` as set now, `auto` when unset. Read on every kernel call (several per
    layer), so from `os.environ`'s own table of encoded names: `os.environ.get` of an unset name raises
    and catches a KeyError inside, ~1 us a call. Changes made through `os.environ` (as
    `monkeypatch.setenv` does) show at once."""
    environ = os.environ
    raw = environ._data.get(environ.encodekey(BACKEND_ENV))  # type: ignore[attr-defined]
    return "auto" if raw is None else str(environ.decodevalue(raw))


def use_triton(t: torch.Tensor) -> bool:
    """True when a kernel call on `t` goes to Triton (see the module docstring for the rules)."""
    choice = backend_choice()
    if choice == "auto":
        return t.is_cuda and triton_available()
    if choice in ("torch", "native"):
        return False
    if choice != "triton":
        raise ValueError(f"{BACKEND_ENV}={choice!r}; expected one of {BACKENDS}")
    if not triton_available():
        raise RuntimeError(f"{BACKEND_ENV}=triton but triton is not installed")
    if not t.is_cuda and not triton_interpreting():
        raise RuntimeError(f"{BACKEND_ENV}=triton on {t.device} tensors needs TRITON_INTERPRET=1")
    return True


def use_native(t: torch.Tensor) -> bool:
    """True when a kernel call on `t` that has a native CPU kernel goes to it (a CPU tensor, and the
    backend `auto` with the kernels built, or `native`)."""
    choice = backend_choice()
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r}; expected one of {BACKENDS}")
    if not t.is_cpu or choice not in ("auto", "native"):
        return False
    from kernels import native

    if native.available():
        return True
    if choice == "native":
        raise RuntimeError(
            f"{BACKEND_ENV}=native but the native CPU kernels could not be built (see the log)"
        )
    return False
