"""The machine a benchmark ran on, as one field of its JSON line.

Figures from different hosts do not compare (this project's sessions have run on Ice Lake, Zen 3, Zen 4,
Sapphire/Emerald Rapids and an AMX Xeon with a 480 MB L3), and what decides a bf16 figure most is which
bf16 units the CPU has: AMX tiles (oneDNN's bf16 matmul on them), AVX512-BF16 pair dot products only, or
none (a bf16 matmul emulated, or widened to fp32 by `kernels.linear`). So every benchmark's last line
carries `host`: the CPU's model name, its logical CPUs, those bf16 units and the torch version, read from
`/proc/cpuinfo` without importing torch's CPU probes (which need a built torch; the vLLM side's parent does
not load one).
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any


def cpu_fields(cpuinfo: str) -> dict[str, Any]:
    """The model name and bf16 units of the first processor in `/proc/cpuinfo`'s text: `bf16_units` is
    `"amx"` (AMX-BF16 tiles, which such CPUs pair with AVX512-BF16), `"avx512_bf16"`, or `"none"`."""
    model, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    units = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "none"
    return {"cpu": model or platform.processor() or platform.machine(), "bf16_units": units}


def host() -> dict[str, Any]:
    """This machine: `cpu` (model name), `cpus` (logical CPUs), `bf16_units` (`cpu_fields`), `torch`."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {**cpu_fields(text), "cpus": os.cpu_count(), "torch": torch_version}
