"""What LoRA costs a mixed run, split in two: its kernels, and the rest (per-step metadata, a prefix cache
shared only within an adapter, scheduling).

Three engines serve the bench workload (`loadtest.bench_models`) at once, a step of each in turn, each timed
on its own steps (`loadtest.bench_engine.run_interleaved`, so this host's drifting speed slows all three
alike): the mixed run; the same mixed run with its LoRA kernel calls skipped (`worker.model.sgmv_group`
replaced by a no-op for that engine's steps only: its tokens differ, its work does not, since every
request runs to its `max_tokens`); and the base model on the same prompts. All three run their layers one
kernel call at a time (`ModelRunner._layers`, not the one native call a step of `kernels.decoder_native`),
so that the skipped one's calls can be replaced. The last line is one JSON object.

    python -m loadtest.lora_cost [--model tiny|small|smollm2] [--requests 128] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

import worker.model
from loadtest.bench_engine import Stepped, run_interleaved, warm_up
from loadtest.bench_models import bench_model, run_header
from loadtest.workload import make_workload
from loragate.types import Request, RequestOutput
from worker.config import EngineConfig
from worker.device import add_device_args, device_args
from worker.engine import LLMEngine


class KernelsSkipped:
    """An engine whose steps run with the LoRA kernels replaced by a no-op (`bench_engine.Stepped`)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.runner.native_layers = None  # its LoRA calls through `worker.model.sgmv_group`, to replace

    def add_request(self, request: Request) -> None:
        self.engine.add_request(request)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[RequestOutput]:
        kernel = worker.model.sgmv_group
        worker.model.sgmv_group = lambda *args, **kwargs: None
        try:
            return self.engine.step()
        finally:
            worker.model.sgmv_group = kernel


def shares(lora_tok_s: float, skipped_tok_s: float, base_tok_s: float) -> dict[str, float]:
    """The shares of the mixed run's time (seconds per token, each engine on its own clock) spent in its
    LoRA kernels, and beyond those in what else it does that the base run does not."""
    lora, skipped, base = 1 / lora_tok_s, 1 / skipped_tok_s, 1 / base_tok_s
    kernels, rest = (lora - skipped) / lora, (skipped - base) / lora
    return {"kernel_share": round(kernels, 3), "rest_share": round(rest, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.lora_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=16, help="distinct adapter names (zoo models)")
    parser.add_argument("--max-loras", type=int, default=16)
    add_device_args(parser)
    args = parser.parse_args(argv)
    device, dtype = device_args(parser, args)
    bench = bench_model(args.model, args.adapters, args.requests)
    config = EngineConfig(adapters=bench.adapters, max_loras=args.max_loras, device=device, dtype=dtype)
    mixed, skipped = LLMEngine(bench.model_dir, config), LLMEngine(bench.model_dir, config)
    base = LLMEngine(bench.model_dir, replace(config, adapters={}))
    for engine in (mixed, skipped, base):
        engine.runner.native_layers = None
    requests = make_workload(bench.workload, mixed.info.vocab_size, list(bench.adapters))
    base_requests = [replace(r, adapter=None) for r in requests]
    for engine, work in ((mixed, requests), (skipped, requests), (base, base_requests)):
        warm_up(engine, work)
    runs: list[tuple[Stepped, list[Request]]] = [
        (mixed, requests),
        (KernelsSkipped(skipped), requests),
        (base, base_requests),
    ]
    lora, no_kernels, plain = run_interleaved(runs, "LoRA / LoRA kernels skipped / base")
    result = {
        **run_header(args.model, device, dtype, requests),
        "lora_tok_s": round(lora.tok_s, 1),
        "lora_kernels_skipped_tok_s": round(no_kernels.tok_s, 1),
        "base_tok_s": round(plain.tok_s, 1),
        "lora_vs_base_ratio": round(lora.tok_s / plain.tok_s, 3),
        **shares(lora.tok_s, no_kernels.tok_s, plain.tok_s),
        "same_lengths": [len(t) for t in lora.tokens] == [len(t) for t in no_kernels.tokens],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
