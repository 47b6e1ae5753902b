"""`loadtest.host`: the machine a benchmark's JSON line names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loadtest.host import cpu_fields, host

AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
ZEN4 = "model name\t: AMD EPYC 9R14 96-Core Processor\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
ZEN3 = "model name\t: AMD EPYC 7R13 Processor\nflags\t\t: fpu avx2 fma\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU part\t: 0xd40\n"


@pytest.mark.parametrize(
    ("text", "cpu", "units"),
    [
        (AMX, "Intel(R) Xeon(R) Processor", "amx"),
        (ZEN4, "AMD EPYC 9R14 96-Core Processor", "avx512_bf16"),
        (ZEN3, "AMD EPYC 7R13 Processor", "none"),
    ],
)
def test_the_cpu_and_its_bf16_units_come_from_cpuinfo(text: str, cpu: str, units: str) -> None:
    assert cpu_fields(text) == {"cpu": cpu, "bf16_units": units}


def test_a_cpuinfo_without_a_model_name_falls_back_to_the_platform() -> None:
    fields = cpu_fields(ARM)
    assert fields["bf16_units"] == "none"  # an Arm `bf16` feature is no x86 bf16 unit the kernels use
    assert fields["cpu"]  # platform.processor() or the machine's name, never empty


def test_this_host_is_described_as_its_cpuinfo_says() -> None:
    here = host()
    assert here["cpus"] == os.cpu_count() and here["torch"] == torch.__version__
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        assert {k: here[k] for k in ("cpu", "bf16_units")} == cpu_fields(cpuinfo.read_text())
        # the kernels' own probe agrees on whether this CPU has any bf16 unit
        amx_or_dp = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
        assert (here["bf16_units"] != "none") == amx_or_dp
