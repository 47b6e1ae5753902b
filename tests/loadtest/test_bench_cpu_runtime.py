"""`loadtest.bench_cpu_runtime`: variants as parsed, the ratios as summarized, a real interleaved run."""

from __future__ import annotations

import json

import pytest

from loadtest import bench_cpu_runtime
from worker.modelzoo.make import ZooPaths


def test_a_variant_is_a_name_and_its_environment() -> None:
    assert bench_cpu_runtime.parse_variant("plain=") == ("plain", {})
    assert bench_cpu_runtime.parse_variant("both=LD_PRELOAD=/a/libiomp5.so:/b/libtc.so,KMP_BLOCKTIME=1") == (
        "both",
        {"LD_PRELOAD": "/a/libiomp5.so:/b/libtc.so", "KMP_BLOCKTIME": "1"},
    )
    for bad in ("plain", "=X=1", "x=NOVALUE", "x==1"):
        with pytest.raises(ValueError):
            bench_cpu_runtime.parse_variant(bad)


def test_each_variant_is_its_median_ratio_to_the_baseline_in_the_same_round() -> None:
    rates = {"a": [100.0, 200.0, 150.0], "b": [110.0, 180.0, 180.0]}
    out = bench_cpu_runtime.summary(["a", "b"], {"a": {}, "b": {"X": "1"}}, rates, {"a": 2, "b": 1})
    assert out["a"] == {"env": {}, "threads": 2, "tok_s": 150.0, "ratio": 1.0, "ratios": [1.0, 1.0, 1.0]}
    assert out["b"]["ratios"] == [1.1, 0.9, 1.2] and out["b"]["ratio"] == 1.1  # not 180 / 150
    assert out["b"]["tok_s"] == 180.0 and out["b"]["env"] == {"X": "1"} and out["b"]["threads"] == 1


def test_two_variants_run_interleaved_each_in_its_own_environment(
    zoo: ZooPaths, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "tiny", "--requests", "16", "--slice", "8", "--rounds", "2", "--max-tokens", "16"]
    argv += ["--max-num-seqs", "8", "--kv-cache-mb", "32", "--variant", "two=OMP_NUM_THREADS=2"]
    assert bench_cpu_runtime.main([*argv, "--variant", "one=OMP_NUM_THREADS=1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["baseline"] == "two" and result["rounds"] == 2 and result["slice_requests"] == 8
    assert result["lora"] is False
    one, two = result["variants"]["one"], result["variants"]["two"]
    assert (one["threads"], two["threads"]) == (1, 2)  # each child got its variant's environment
    assert two["ratios"] == [1.0, 1.0] and len(one["ratios"]) == 2
    assert one["tok_s"] > 0 and two["tok_s"] > 0 and one["env"] == {"OMP_NUM_THREADS": "1"}


def test_the_lora_workload_is_bench_vllms_mixed_adapter_job(zoo: ZooPaths) -> None:
    argv = ["--model", "tiny", "--requests", "12", "--slice", "5", "--max-tokens", "3", "--variant", "a="]
    base = bench_cpu_runtime.make_job(bench_cpu_runtime.build_parser().parse_args([*argv, "--variant", "b="]))
    lora = bench_cpu_runtime.make_job(bench_cpu_runtime.build_parser().parse_args([*argv, "--lora"]))
    assert (
        base["adapters"] == {}
        and lora["adapters"]
        and all((zoo.root / "adapters" / "tiny").as_posix() in path for path in lora["adapters"].values())
    )
    rows = [r for piece in lora["slices"] for r in piece]
    assert [len(piece) for piece in lora["slices"]] == [5, 5, 2] and all(r["max_tokens"] <= 3 for r in rows)
    assert {r["adapter"] for r in rows} <= set(lora["adapters"]) | {None} and any(r["adapter"] for r in rows)
    assert [r["prompt"] for piece in base["slices"] for r in piece] == [
        r["prompt"] for r in rows
    ]  # one workload
    assert all(r["adapter"] is None for piece in base["slices"] for r in piece)


def test_fewer_than_two_variants_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench_cpu_runtime.main(["--variant", "plain="])
