"""Where the engine runs and in what precision: `--device` / `--dtype` specs resolved to torch values.

`resolve_device` turns `auto | cpu | cuda | cuda:N` into the device string every engine tensor is made on
(`auto` is the GPU when torch sees one); `resolve_dtype` turns `auto | float32 | bfloat16 | float16` into
the dtype of weights, KV cache and adapter slots (`auto`: float32 on CPU, bfloat16 on a GPU that supports
it, else float16). float16 on CPU is allowed: every op runs (the CPU kernel paths compute fp16 in fp32),
but it is slower than float32 or bfloat16 there and only worth it to check fp16 numerics without a GPU.
`host_to_device` is the one way the step path moves host-built values to the device: through pinned
memory and a non-blocking copy on CUDA, so building a step never waits for the GPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

DEVICE_SPECS = "auto, cpu, cuda, cuda:N"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_SPECS = ("auto", *DTYPES)


def resolve_device(spec: str) -> str:
    """`cpu`, `cuda` or `cuda:N` for a device spec; ValueError naming what is allowed otherwise."""
    s = spec.strip().lower()
    if s == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if s == "cpu":
        return "cpu"
    kind, _, index = s.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device {spec!r} is not one of {DEVICE_SPECS}")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"device {spec!r}: CUDA is not available (torch {torch.__version__} is {build}, "
            "or no GPU is visible); use cpu or auto"
        )
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"device {spec!r}: there are {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return f"cuda:{int(index)}" if index else "cuda"


def resolve_dtype(spec: str, device: str) -> torch.dtype:
    """The engine dtype for a dtype spec on a resolved `device`; ValueError naming what is allowed."""
    s = spec.strip().lower()
    on_cuda = torch.device(device).type == "cuda"
    if s == "auto":
        if not on_cuda:
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if s not in DTYPES:
        raise ValueError(f"dtype {spec!r} is not one of {', '.join(DTYPE_SPECS)}")
    if s == "bfloat16" and on_cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(f"dtype bfloat16 is not supported on {device}; use float16 or float32")
    return DTYPES[s]


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype`, as `loragate worker` and the engine benchmark take them."""
    parser.add_argument(
        "--device", default="auto", help=f"where the engine runs: {DEVICE_SPECS} (default: auto)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help=f"precision of weights, KV cache and adapters: {', '.join(DTYPE_SPECS)} (default: auto = "
        "float32 on CPU, bfloat16 on a GPU that supports it, else float16)",
    )


SWITCH = {"auto": None, "on": True, "off": False}  # an `auto|on|off` flag's value, as an EngineConfig field's


def add_switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """A `flag auto|on|off` option (default auto); `SWITCH[value]` is its None, True or False."""
    parser.add_argument(flag, choices=tuple(SWITCH), default="auto", help=help)


def device_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """The resolved `(device, dtype)` of parsed `add_device_args` flags; a usage error names the flag."""
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        parser.error(f"--device: {e}")
    try:
        return device, resolve_dtype(args.dtype, device)
    except ValueError as e:
        parser.error(f"--dtype: {e}")


def dtype_name(dtype: torch.dtype) -> str:
    """`float32`, `bfloat16`, `float16`: the spec that resolves to `dtype`."""
    return str(dtype).removeprefix("torch.")


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def host_to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`. On CUDA the copy is queued from pinned memory and returns
    at once (a copy from pageable memory would wait for the GPU's queue to drain first)."""
    host = torch.tensor(values, dtype=dtype)
    if not is_cuda(device):
        return host if torch.device(device).type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
