"""`loadtest.lora_cost`: the skipped engine computes the base model (its tokens are the base run's, not the
mixed run's), and the shares split the mixed run's time per token."""

from __future__ import annotations

from dataclasses import replace

import worker.model
from loadtest import lora_cost
from loadtest.bench_models import bench_model
from loadtest.workload import make_workload
from worker.config import EngineConfig
from worker.engine import LLMEngine


def test_shares_split_the_mixed_runs_time() -> None:
    # 100 tok/s mixed (10 ms a token), 125 without its kernels (8 ms), 200 base (5 ms).
    assert lora_cost.shares(100.0, 125.0, 200.0) == {"kernel_share": 0.2, "rest_share": 0.3}


def test_skipping_the_kernels_leaves_the_base_model() -> None:
    bench = bench_model("tiny", 2, 4)
    config = EngineConfig(adapters=bench.adapters, max_loras=4)
    engine = LLMEngine(bench.model_dir, config)
    requests = make_workload(bench.workload, engine.info.vocab_size, list(bench.adapters))[:3]
    requests = [replace(r, params=replace(r.params, max_tokens=12)) for r in requests if r.adapter]
    assert requests
    mixed = {o.request_id: o.token_ids for o in engine.generate(requests)}
    engine.reset_state()  # no prefix-cache hits on the KV the adapters made
    skipped, kernel = lora_cost.KernelsSkipped(engine), worker.model.sgmv_group
    for r in requests:
        skipped.add_request(replace(r, request_id=r.request_id + "-skipped"))
    tokens: dict[str, list[int]] = {}
    while skipped.has_work():
        for out in skipped.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert worker.model.sgmv_group is kernel  # restored after every step
    engine.reset_state()
    base = {o.request_id: o.token_ids for o in engine.generate([replace(r, adapter=None) for r in requests])}
    for r in requests:
        assert tokens[r.request_id + "-skipped"] == list(base[r.request_id])
    assert any(tokens[r.request_id + "-skipped"] != list(mixed[r.request_id]) for r in requests if r.adapter)
