"""`loadtest.lora_replay`: a captured step's kernel calls replay to the engine's results bit for bit, and the
tool reports each replay per thread count."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from loadtest import lora_replay
from loadtest.bench_models import bench_model
from loadtest.workload import make_workload
from worker.config import EngineConfig
from worker.engine import LLMEngine


def test_a_captured_step_replays_to_the_engines_results() -> None:
    bench = bench_model("tiny", 3, 6)
    engine = LLMEngine(bench.model_dir, EngineConfig(adapters=bench.adapters, max_loras=4))
    for r in make_workload(bench.workload, engine.info.vocab_size, list(bench.adapters)):
        engine.add_request(replace(r, params=replace(r.params, max_tokens=16)))
    calls = lora_replay.capture(engine, warm_steps=3)
    assert calls and {c.layer for c in calls} == set(range(engine.model_config.num_layers))
    assert any(not torch.equal(c.y_before, c.y_after) for c in calls)  # the adapters changed the outputs
    groups = [c.group for c in calls]
    assert lora_replay.replay(calls, groups, check=True) > 0
    lora_replay.replay(calls, [lora_replay.unadapted(g) for g in groups], check=False)
    calls[0].y_after = calls[0].y_after + 1  # a replay that differs from what the engine computed is refused
    with pytest.raises(AssertionError, match="differs"):
        lora_replay.replay(calls, groups, check=True)


def test_the_tool_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "tiny", "--adapters", "3", "--requests", "6", "--warm-steps", "3"]
    assert lora_replay.main([*args, "--threads", "1,2", "--rounds", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"] == "tiny" and result["calls"] > 0 and result["segments"] > 0
    assert 0 < result["adapted_tokens"] <= result["tokens"] and result["weight_mb"] > 0
    for threads in ("threads=1", "threads=2"):
        assert set(result["ms_per_step"][threads]) == {"cold", "hot", "fixed"}
        assert all(ms > 0 for ms in result["ms_per_step"][threads].values())
        assert result["fixed_us_per_call"][threads] > 0
