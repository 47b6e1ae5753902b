"""One decode step's LoRA kernel calls, captured from a real engine and replayed on their own: what the
native `sgmv_group` kernel costs a step, without the rest of the step around it.

An engine serves the bench workload (`loadtest.bench_models`) until every request is decoding, then one step's
`sgmv_group` calls are recorded (each call's input, its output before and after, its group: the adapter
stacks and the step's segments as the engine built them). Replaying them is deterministic: each replayed
call's output must equal the engine's, bit for bit, or the tool stops. Three replays, each with the calls'
inputs and outputs restored before each call (as in the engine, where the base layer just wrote them) and
only the kernel calls timed:

- `cold`: the step's calls in order, every layer's adapters read from wherever they are (L3 or memory);
- `hot`: the first layer's calls once per layer, its adapters staying in L2 (the cost without moving weights);
- `fixed`: the calls with no segment adapted (the cost of a call that does nothing: dispatch and set-up).

Each is timed with each thread count in `--threads`, `--rounds` times in turn; the medians are reported. This
host's speed drifts by up to a third within minutes, so kernel variants are best compared within one run.
The last line is one JSON object.

    python -m loadtest.lora_replay [--model smollm2] [--dtype bfloat16] [--threads 1,2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

import kernels.sgmv_native
from kernels.lora_meta import LoRAGroup
from loadtest.bench_models import bench_model, run_header
from loadtest.workload import make_workload
from worker.config import EngineConfig
from worker.device import add_device_args, device_args
from worker.engine import LLMEngine


@dataclass
class Call:
    """One recorded kernel call: its output before and after, its input, its group and layer."""

    y_before: torch.Tensor
    y_after: torch.Tensor
    x: torch.Tensor
    group: LoRAGroup
    layer: int


def capture(engine: LLMEngine, warm_steps: int) -> list[Call]:
    """`warm_steps` steps of the engine, then the next step's native `sgmv_group` calls (that step's layers
    one kernel call at a time, `ModelRunner._layers`, so that the calls pass through Python to be recorded;
    the same calls on the same inputs as in one native call a step)."""
    for _ in range(warm_steps):
        engine.step()
    calls: list[Call] = []
    native = kernels.sgmv_native.sgmv_group_native

    def record(y: torch.Tensor, x: torch.Tensor, group: LoRAGroup, *, layer: int) -> None:
        before = y.clone()
        native(y, x, group, layer=layer)
        calls.append(Call(before, y.clone(), x.clone(), group, layer))

    kernels.sgmv_native.sgmv_group_native = record
    layers, engine.runner.native_layers = engine.runner.native_layers, None  # each call through Python
    try:
        engine.step()
    finally:
        kernels.sgmv_native.sgmv_group_native = native
        engine.runner.native_layers = layers
    return calls


def unadapted(group: LoRAGroup) -> LoRAGroup:
    """`group` with no segment: a call that adapts no token."""
    return replace(group, meta=replace(group.meta, segments=()))


def replay(calls: Sequence[Call], groups: Sequence[LoRAGroup], check: bool) -> float:
    """Seconds the kernel calls took, each call's output and input restored before it (and its result
    checked against the engine's when `check`)."""
    total = 0.0
    for call, group in zip(calls, groups, strict=True):
        y = call.y_before.clone()
        x = call.x.clone()
        start = time.perf_counter()
        kernels.sgmv_native.sgmv_group_native(y, x, group, layer=call.layer)
        total += time.perf_counter() - start
        if check and not torch.equal(y, call.y_after):
            raise AssertionError(f"replayed layer {call.layer} call differs from the engine's")
    return total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.lora_replay", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=16, help="distinct adapter names (zoo models)")
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--warm-steps", type=int, default=12, help="steps before the captured one")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=20)
    add_device_args(parser)
    args = parser.parse_args(argv)
    device, dtype = device_args(parser, args)
    if device != "cpu":
        parser.error("the replay times the native CPU kernel: --device cpu")
    bench = bench_model(args.model, args.adapters, args.requests)
    engine = LLMEngine(
        bench.model_dir, EngineConfig(adapters=bench.adapters, max_loras=args.max_loras, dtype=dtype)
    )
    requests = make_workload(bench.workload, engine.info.vocab_size, list(bench.adapters))
    for r in requests:  # long enough that no request finishes before the captured step
        engine.add_request(replace(r, params=replace(r.params, max_tokens=args.warm_steps + 64)))
    calls = capture(engine, args.warm_steps)
    if not calls:
        raise SystemExit("the captured step ran no LoRA kernel call")
    first = min(c.layer for c in calls)
    hot = [c for c in calls if c.layer == first] * (len(calls) // sum(c.layer == first for c in calls))
    suites = {
        "cold": (calls, [c.group for c in calls]),
        "hot": (hot, [c.group for c in hot]),
        "fixed": (calls, [unadapted(c.group) for c in calls]),
    }
    replay(calls, suites["cold"][1], check=True)  # the replay computes what the engine computed
    threads = [int(t) for t in args.threads.split(",")]
    times: dict[tuple[int, str], list[float]] = {(t, s): [] for t in threads for s in suites}
    previous = torch.get_num_threads()
    try:
        for i in range(args.rounds):
            for t in threads if i % 2 == 0 else threads[::-1]:
                torch.set_num_threads(t)
                for name, (suite, groups) in suites.items():
                    times[t, name].append(replay(suite, groups, check=False))
    finally:
        torch.set_num_threads(previous)
    segments = calls[0].group.meta.segments
    slots = {slot for _, _, slot in segments}
    weights = sum(  # what one step's calls read of the adapters
        int(p.ranks[slot]) * (p.a.shape[3] + p.b.shape[2]) * p.a.element_size()
        for c in calls
        for p in c.group.projections
        for slot in slots
    )
    result = {
        **run_header(args.model, device, dtype, requests),
        "calls": len(calls),
        "tokens": int(calls[0].x.shape[0]),
        "adapted_tokens": sum(end - start for start, end, _ in segments),
        "segments": len(segments),
        "weight_mb": round(weights / 1e6, 2),
        "ms_per_step": {
            f"threads={t}": {name: round(statistics.median(times[t, name]) * 1e3, 3) for name in suites}
            for t in threads
        },
        "fixed_us_per_call": {
            f"threads={t}": round(statistics.median(times[t, "fixed"]) / len(calls) * 1e6, 2) for t in threads
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
