"""`loadtest.bench_decode_pool`: the same decode over a huge-page pool and a 4 KiB-page one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench_decode_pool


def test_a_quick_run_reports_both_pools_and_their_pages(capsys: pytest.CaptureFixture[str]) -> None:
    # the bench itself refuses two pools whose outputs differ
    assert bench_decode_pool.main(["--quick", "--dtype", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dtype"] == "bfloat16" and report["layers"] == 2 and report["rounds"] == 2
    for pool in ("huge_pages", "small_pages"):
        assert report[f"{pool}_ms"] > 0 and report[f"{pool}_gb_s"] > 0
    assert report["speedup"] == pytest.approx(report["small_pages_ms"] / report["huge_pages_ms"], rel=0.02)
    assert report["host"]["cpus"] >= 1 and report["host"]["bf16_units"] in ("amx", "avx512_bf16", "none")
    assert report["small_pages_huge_share"] == 0.0  # MADV_NOHUGEPAGE holds whatever the host's setting
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert report["huge_pages_huge_share"] > 0.5  # the worker's pool got huge pages where THP allows
