"""`loadtest.bench_engine` end to end on a small workload: every key issue 15 reads, loragate and both
transformers sides measured, fp32 tokens equal to the transformers + peft reference; and SmolLM2's
benchmark adapters shaped as the issue measured (ranks 8/16, half on every projection, half on q/v)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from loadtest import bench_engine, profile_engine
from loadtest.bench_models import SMOLLM2_ADAPTERS, smollm2_adapters
from loragate.types import Request, RequestOutput

KEYS = (
    "loragate_tok_s", "loragate_base_tok_s", "hf_peft_tok_s", "hf_base_tok_s", "speedup_vs_hf_peft",
    "base_vs_hf_base", "lora_vs_base_ratio", "tokens_match", "dtype", "model",
)  # fmt: skip


def run_bench(argv: list[str]) -> dict[str, Any]:
    """`bench_engine.main(argv)`'s JSON line (its stdout caught here: module fixtures get no capsys)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_engine.main(argv) == 0
    result: dict[str, Any] = json.loads(out.getvalue().strip().splitlines()[-1])
    return result


# Each request's first 16 tokens: every step kind (prefill, mixed, decode) and enough steps for the steady
# rate's 10-90 % window, at a fraction of the full workload's decoding (and of the reference's).
SMALL = ["--model", "tiny", "--requests", "4", "--adapters", "2", "--max-tokens", "16"]


@pytest.fixture(scope="module")
def warm_rounds() -> dict[str, Any]:
    """One loragate-only run for the two tests below: three ABBA rounds, the engines' warm-up on."""
    # A batch cap of 4 (the workload's size) keeps the warm-up's ladder short: batches of 1, 2 and 4.
    argv = [*SMALL, "--skip-hf", "--check-sample", "1", "--rounds", "3", "--warmup", "on"]
    return run_bench([*argv, "--max-num-seqs", "4"])


def test_bench_engine_reports_every_side() -> None:
    result = run_bench([*SMALL, "--hf-batch-size", "4", "--check-sample", "2"])
    assert set(KEYS) <= set(result)
    assert (result["model"], result["dtype"], result["tokens_match"]) == ("tiny", "float32", True)
    assert result["output_tokens"] == 4 * 16  # every request of the workload asks for more than 16
    for key in ("loragate_tok_s", "loragate_base_tok_s", "hf_peft_tok_s", "hf_base_tok_s"):
        assert result[key] > 0, key
    assert result["base_vs_hf_base"] == pytest.approx(
        result["loragate_base_tok_s"] / result["hf_base_tok_s"], rel=0.02
    )
    steady = ["loragate_steady_tok_s", "loragate_base_steady_tok_s", "slowest_step_ms"]
    for key in [*steady, "base_slowest_step_ms"]:
        assert result[key] > 0, key
    # On a CPU the engine compiles nothing and warms up only when asked (the test below).
    assert result["warmup_s"] is None
    assert result["kernels_compiled_in_warmup"] == result["kernels_compiled_after_warmup"] == 0


def test_bench_engine_rounds_alternate_the_engines(warm_rounds: dict[str, Any]) -> None:
    result = warm_rounds
    assert result["rounds"] == 3 and len(result["loragate_tok_s_rounds"]) == 3
    assert result["loragate_tok_s"] == sorted(result["loragate_tok_s_rounds"])[1]  # the median run
    assert result["loragate_base_tok_s"] == sorted(result["loragate_base_tok_s_rounds"])[1]
    assert result["tokens_stable_across_rounds"] is True and result["tokens_match"] is True
    # Then both engines at once, a step each in turn, each on its own clock: the same tokens (in the
    # stability check above), their own rates.
    lora, base = result["loragate_interleaved_tok_s"], result["loragate_base_interleaved_tok_s"]
    assert lora > 0 and base > 0
    # The ratio of the unrounded rates, to a thousandth; the rates as printed are rounded to a tenth.
    rounding = 0.05 * (1 + lora / base) / (base - 0.05)  # the most (lora ± 0.05) / (base ∓ 0.05) moves
    assert result["interleaved_lora_vs_base_ratio"] == pytest.approx(lora / base, abs=1e-3 + rounding)
    assert bench_engine.rounds(3) == ["LoRA", "base", "base", "LoRA", "LoRA", "base"]
    with pytest.raises(SystemExit):
        bench_engine.main([*SMALL, "--skip-hf", "--rounds", "0"])


def test_bench_engine_with_the_engines_warm_up(warm_rounds: dict[str, Any]) -> None:
    result = warm_rounds
    assert result["warmup_s"] > 0 and result["warmup_steps"] > 0
    assert result["max_num_seqs"] == 4
    assert result["tokens_match"] is True and result["hf_peft_tok_s"] is None
    # No decode graphs on a CPU by default (`--cuda-graphs auto`).
    assert result["cuda_graphs"] is False and result["graph_capture_s"] is None
    assert result["graphs_captured"] == 0 and result["graph_steps"] == 0


def test_profile_engine_busy_share(capsys: pytest.CaptureFixture[str]) -> None:
    """`--kineto`: the run under torch's profiler; on a CPU the top host ops, no device figures."""
    argv = ["--model", "tiny", "--requests", "3", "--adapters", "2", "--max-tokens", "16", "--kineto"]
    assert profile_engine.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["output_tokens"] > 0 and result["steps"] > 0 and result["tok_s"] > 0
    assert result["device_busy_share"] is None and result["kernel_launches_per_step"] is None
    assert result["cuda_graphs"] is False and result["graph_steps"] == 0
    names = [k["name"] for k in result["top_kernels"]]
    assert len(names) == 12 and any(n.startswith("aten::") for n in names)
    times = [k["self_s"] for k in result["top_kernels"]]
    assert times == sorted(times, reverse=True) and times[0] > 0


def test_profile_engine_categories_split_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The timed categories: every step's forward is timed whichever way it enters the model (logits, or
    the greedy pick without them), the LM head is its own category, and the parts add up to the wall."""
    argv = ["--model", "tiny", "--requests", "3", "--adapters", "2", "--max-tokens", "12"]
    assert profile_engine.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    seconds, calls = result["seconds"], result["calls"]
    steps = result["steps"]  # the run's own (the warm-up request's ran before the timers)
    assert calls["forward"] == steps == calls["lm_head"]
    layers = 4
    assert calls["linear"] == 4 * layers * steps and calls["lora"] == 4 * layers * steps
    for category in ("linear", "lm_head", "lora", "attention_decode", "attention_prefill", "rope_write_kv"):
        assert seconds[category] > 0, category
    assert seconds["model_other"] >= 0 and seconds["step_other"] >= 0
    assert sum(seconds.values()) == pytest.approx(result["wall_s"], abs=0.01)


def test_steady_rate_leaves_out_the_first_and_last_tenth() -> None:
    # A slow first step (2 s for 10 tokens), then 10 tokens every 0.1 s up to 100.
    marks = [(2.0, 10)] + [(2.0 + 0.1 * i, 10 + 10 * i) for i in range(1, 10)]
    assert bench_engine.steady_rate(marks) == pytest.approx(100.0)
    assert bench_engine.steady_rate([]) == 0.0
    assert bench_engine.steady_rate([(1.0, 50)]) == 0.0  # one step: no interval to measure


def test_smollm2_bench_adapters_are_the_issues_shape(smollm2: Path) -> None:
    paths = smollm2_adapters(smollm2)
    configs = {name: json.loads((path / "adapter_config.json").read_text()) for name, path in paths.items()}
    assert len(configs) == len(SMOLLM2_ADAPTERS) == 8
    assert sorted(c["r"] for c in configs.values()) == [8] * 4 + [16] * 4
    targets = sorted(len(c["target_modules"]) for c in configs.values())
    assert targets == [2] * 4 + [7] * 4


class _Recorder:
    """Steps that only record their turn (the harness's order is what is tested, not an engine)."""

    def __init__(self, name: str, steps: int, turns: list[str]):
        self.name, self.left, self.turns = name, steps, turns

    def add_request(self, request: Request) -> None:
        pass

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list[RequestOutput]:
        self.left -= 1
        self.turns.append(self.name)
        return []


def test_run_interleaved_reverses_the_turn_order_every_round() -> None:
    """Each engine follows each other one alike (a fixed order measured the first one ~2.5 % slower)."""
    turns: list[str] = []
    runs = [(_Recorder(name, 3, turns), []) for name in "abc"]
    bench_engine.run_interleaved(runs, "order")
    assert "".join(turns) == "abccbaabc"
