"""`loadtest.bench_vllm`: the jobs both engines get, the order of their runs, loragate's side as a real
child process (its tokens against transformers + peft), the figures it reports, and its refusals when vLLM
is missing. The whole comparison runs when `$LORAGATE_VLLM_PYTHON` names an interpreter that has vLLM
(vLLM is not one of loragate's dependencies: it pins a transformers of its own)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from loadtest import bench_vllm
from loadtest.hf_reference import HFReference
from loadtest.serve_clients import StreamStats, summarize
from loadtest.vllm_server import vllm_figures


def test_both_engines_get_the_same_requests_and_a_warm_up_that_loads_every_adapter() -> None:
    jobs = bench_vllm.make_jobs("tiny", "float32", 3, 12)
    base, lora = jobs["base"], jobs["lora"]
    assert [(r["prompt"], r["max_tokens"]) for r in base["requests"]] == [
        (r["prompt"], r["max_tokens"]) for r in lora["requests"]
    ]
    assert all(r["adapter"] is None for r in base["requests"] + base["warmup"])
    assert not base["lora"] and lora["lora"]
    assert {r["adapter"] for r in lora["requests"]} - {None}, "the mixed workload adapts nothing"
    assert set(lora["adapters"]) <= {r["adapter"] for r in lora["warmup"]}
    # The warm-up is short and finds nothing of the timed prompts in a prefix cache.
    timed = {tuple(r["prompt"]) for r in lora["requests"]}
    assert all(r["max_tokens"] == 4 and tuple(r["prompt"]) not in timed for r in lora["warmup"])
    ranks = [
        json.loads((Path(p) / "adapter_config.json").read_text())["r"] for p in lora["adapters"].values()
    ]
    assert lora["max_lora_rank"] == max(ranks)


def test_every_round_runs_each_engine_and_mode_once_and_every_other_round_is_reversed() -> None:
    runs = bench_vllm.order(3)
    rounds = [runs[i : i + 4] for i in range(0, len(runs), 4)]
    assert len(rounds) == 3
    for r in rounds:
        assert sorted(r) == sorted(itertools.product(bench_vllm.ENGINES, bench_vllm.MODES))
    assert rounds[1] == rounds[0][::-1] and rounds[2] == rounds[0]


def run(tok_s: float, tokens: list[list[int]], version: str = "x") -> dict[str, Any]:
    return {"tok_s": tok_s, "tokens": tokens, "output_tokens": 3, "version": version, "settings": {}}


def test_the_figures_are_each_engines_median_run_and_tokens_are_compared_per_request() -> None:
    jobs = bench_vllm.make_jobs("tiny", "float32", 2, 2)
    a, b = [[1, 2], [3]], [[1, 2], [4]]
    runs = {
        ("vllm", "base"): [run(100, a), run(300, a), run(200, a)],
        ("loragate", "base"): [run(150, a), run(250, a), run(350, a)],
        ("vllm", "lora"): [run(40, b), run(60, b), run(50, b)],
        ("loragate", "lora"): [run(210, a), run(190, a), run(200, a)],
    }
    result = bench_vllm.summary(jobs, runs)
    assert (result["vllm_base_tok_s"], result["loragate_base_tok_s"]) == (200, 250)
    assert (result["vllm_lora_tok_s"], result["loragate_tok_s"]) == (50, 200)
    assert result["base_vs_vllm"] == 1.25 and result["lora_vs_vllm"] == 4.0
    assert result["vllm_lora_vs_base"] == 0.25 and result["lora_vs_base_ratio"] == 0.8
    assert result["loragate_lora_tok_s_rounds"] == [210, 190, 200]
    assert (result["base_tokens_match_vllm"], result["lora_tokens_match_vllm"]) == (2, 1)
    assert all(result["tokens_stable_across_rounds"].values())
    runs["vllm", "base"][2] = run(200, b)
    stable = bench_vllm.summary(jobs, runs)["tokens_stable_across_rounds"]
    assert [key for key, same in stable.items() if not same] == ["vllm_base"]


def test_loragates_side_runs_as_a_child_and_its_tokens_are_transformers_and_peft_greedy(
    tmp_path: Path,
) -> None:
    jobs = bench_vllm.make_jobs("tiny", "float32", 2, 10)
    for job in jobs.values():
        job["requests"] = [{**r, "max_tokens": min(r["max_tokens"], 12)} for r in job["requests"]]
    lora = jobs["lora"]
    plain = [i for i, r in enumerate(lora["requests"]) if r["adapter"] is None]
    adapted = [i for i, r in enumerate(lora["requests"]) if r["adapter"] is not None]
    assert plain and adapted, "the workload must hold both kinds of request"

    def child(mode: str) -> dict[str, Any]:
        (tmp_path / f"{mode}.json").write_text(json.dumps(jobs[mode]))
        cmd = [sys.executable, "-m", "loadtest.bench_vllm", "--loragate-child"]
        files = [str(tmp_path / f"{mode}.json"), str(tmp_path / f"{mode}.out.json")]
        # Bounded below the test's own limit: a thread cannot be stopped, only its child killed.
        return bench_vllm.run_child([*cmd, *files], {}, tmp_path / f"{mode}.log", Path(files[1]), 200)

    # Both children side by side, and the reference's tokens made meanwhile: each child is mostly its
    # start (imports, model load), and only tokens and token counts are checked here, not the speeds the
    # benchmark times one child at a time.
    with ThreadPoolExecutor(len(jobs)) as pool:
        running = {mode: pool.submit(child, mode) for mode in jobs}
        ref = HFReference(Path(lora["model_dir"]), {n: Path(p) for n, p in lora["adapters"].items()})
        expected = {
            i: ref.greedy(r["prompt"], r["max_tokens"], r["adapter"])
            for i, r in ((i, lora["requests"][i]) for i in (plain[0], adapted[0]))
        }
        out = {mode: future.result() for mode, future in running.items()}
    for mode in out:
        assert (
            out[mode]["output_tokens"] == sum(r["max_tokens"] for r in lora["requests"])
            and out[mode]["tok_s"] > 0
        )
    assert out["lora"]["settings"]["threads"] >= 1
    # A request without an adapter gets the same tokens from the engine with adapters and the one without.
    assert all(out["lora"]["tokens"][i] == out["base"]["tokens"][i] for i in plain)
    for i, tokens in expected.items():
        assert tokens == out["lora"]["tokens"][i], lora["requests"][i]["adapter"]
    assert out["lora"]["tokens"][adapted[0]] != out["base"]["tokens"][adapted[0]], (
        "the adapter changed nothing"
    )


def test_without_an_interpreter_for_vllm_it_says_which_flag_names_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LORAGATE_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit) as stop:
        bench_vllm.main(["--model", "tiny"])
    assert stop.value.code == 2 and "--vllm-python" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter has vLLM")
def test_an_interpreter_without_vllm_is_refused_before_any_run() -> None:
    with pytest.raises(SystemExit) as stop:
        bench_vllm.main(["--model", "tiny", "--vllm-python", sys.executable])
    assert "cannot import vllm" in str(stop.value.code)


@pytest.mark.skipif(not os.environ.get("LORAGATE_VLLM_PYTHON"), reason="$LORAGATE_VLLM_PYTHON names no vLLM")
def test_the_whole_comparison_against_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--requests", "6", "--adapters", "2", "--rounds", "1"]
    assert bench_vllm.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("vllm_base_tok_s", "loragate_base_tok_s", "vllm_lora_tok_s", "loragate_tok_s"):
        assert result[key] > 0, key
    assert result["base_vs_vllm"] == pytest.approx(
        result["loragate_base_tok_s"] / result["vllm_base_tok_s"], rel=0.01
    )
    counted = set(result["output_tokens_counted"].values())
    assert counted == {result["output_tokens"]}, "an engine produced other than the requested tokens"
    # fp32 greedy on the same checkpoint: most requests agree token for token (the two engines sum in
    # different orders, so a near-tie may go either way).
    assert result["base_tokens_match_vllm"] >= result["requests"] // 2
    assert result["lora_tokens_match_vllm"] >= result["requests"] // 2


def test_a_vllm_level_is_summarized_under_loragates_names_without_offline_figures() -> None:
    results = [
        StreamStats(ttft_s=0.1, itl_s=[0.02, 0.04], tokens=3),
        StreamStats(ttft_s=0.3, itl_s=[0.06], tokens=2, error="incomplete"),
    ]
    figures = vllm_figures(results, wall_s=2.0)
    assert figures["serve_tok_s"] == 2.5 and figures["errors"] == 1 and figures["wall_s"] == 2.0
    assert figures["ttft_p50_ms"] == 200.0 and figures["itl_p50_ms"] == 40.0
    assert "offline_tok_s" not in summarize(results, 2.0) and "serve_vs_offline" in summarize(
        results, 2.0, 4, 5
    )
