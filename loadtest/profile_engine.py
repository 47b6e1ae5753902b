"""Where an engine step's time goes, by category, on the bench workload (`loadtest.bench_models`).

Wraps the model runner's parts with wall-clock timers (the CPU path is synchronous; on CUDA each timer
synchronizes first, which slows the run but keeps the split honest) and runs the workload once, the layers
one kernel call at a time (`ModelRunner._layers`: where the engine runs them in one native call a step,
`kernels.decoder_native`, the timers could not see its parts, so the profile shows the Python layers'
overhead that call saves in `model_other`):

- `linear`: the base projections (`kernels.linear` in `worker.model`; SiLU too where the AMX kernel fuses it);
- `lm_head`: the LM head, its logits or (greedy steps on a CPU) each row's pick without them;
- `lora`: every adapter's shrink and expand (`ModelRunner._lora`);
- `attention_decode`, `attention_prefill`: the paged-attention kernels;
- `rope_write_kv`: RoPE on q and k and the KV writes (one call a layer);
- `model_other`: the rest of the forward (embedding, norms, activations, residual adds);
- `step_other`: the step outside the forward (scheduling, batch layout, sampling, detokenizing).

    python -m loadtest.profile_engine [--model smollm2] [--requests 48] [--base] [--dtype float32] [--kineto]
        [--max-tokens N]

`--max-tokens N` caps each request's output tokens (quick runs, tests: the same prompts and adapters).

`--kineto` runs the workload under torch's profiler instead, unsynchronized, and reports how busy the
device was: its kernels' time against the wall clock, kernel launches per step and the kernels that took
longest (on a GPU a busy share well under 1 means the step is bound by host work: launches, Python).

The last line printed is one JSON object: seconds and share per category, call counts, tok/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

import worker.model as model_module
from loadtest.bench_models import bench_model
from loadtest.host import host
from loadtest.workload import capped, make_workload
from loragate.types import Request
from worker.config import EngineConfig
from worker.device import SWITCH, add_device_args, add_switch, device_args, dtype_name, is_cuda
from worker.engine import LLMEngine

CATEGORIES = ("linear", "lm_head", "lora", "attention_decode", "attention_prefill", "rope_write_kv")


class Timers:
    """Wall-clock seconds and calls per category; `wrap` times a callable under one category."""

    def __init__(self, cuda: bool):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.cuda = cuda

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += self._now() - start
                self.calls[category] += 1

        return timed


def instrument(engine: LLMEngine, timers: Timers) -> None:
    """Time `engine`'s runner by category (patches `worker.model`'s names for this process: a tool only)."""
    runner = engine.runner
    runner.native_layers = None  # each kernel called (and timed) on its own
    for name, category in (
        ("paged_attention_decode", "attention_decode"),
        ("paged_attention_prefill", "attention_prefill"),
        ("rope_write_kv", "rope_write_kv"),
        ("linear", "linear"),
        ("linear_silu_mul", "linear"),
        ("lm_head_logits", "lm_head"),
        ("lm_head_argmax", "lm_head"),
    ):
        setattr(model_module, name, timers.wrap(category, getattr(model_module, name)))
    runner._lora = timers.wrap("lora", runner._lora)  # type: ignore[method-assign]
    # A step enters the model through one of these two: logits, or greedy picks without them.
    runner.forward = timers.wrap("forward", runner.forward)  # type: ignore[method-assign]
    runner.greedy_tokens = timers.wrap("forward", runner.greedy_tokens)  # type: ignore[method-assign]


def run(engine: LLMEngine, requests: list[Request]) -> tuple[int, float]:
    """Run `requests` to completion: (output tokens, wall seconds)."""
    total = sum(r.params.max_tokens for r in requests)
    for r in requests:
        engine.add_request(r)
    start = time.perf_counter()
    with tqdm(total=total, desc="profile", unit="tok", file=sys.stderr) as bar:
        while engine.has_work():
            for out in engine.step():
                bar.update(len(out.new_token_ids))
    return total, time.perf_counter() - start


def busy_profile(engine: LLMEngine, requests: list[Request], cuda: bool, top: int = 12) -> dict[str, Any]:
    """The run under torch's profiler: the device's kernel time against the wall clock, launches per step
    and the `top` kernels by device time (on a CPU only host ops are recorded: no device figures)."""
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    steps = engine.snapshot().steps
    with profile(activities=activities) as prof:
        total, wall = run(engine, requests)
        if cuda:
            torch.cuda.synchronize()
    steps = engine.snapshot().steps - steps
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    # The top device kernels on a GPU; the top host ops on a CPU (where they are the compute).
    events = kernels if cuda else list(prof.key_averages())
    time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    ranked = sorted(events, key=time_of, reverse=True)[:top]
    return {
        "output_tokens": total,
        "tok_s": round(total / wall, 1),
        "wall_s": round(wall, 2),
        "steps": steps,
        "device_busy_s": round(busy, 3) if cuda else None,
        "device_busy_share": round(busy / wall, 3) if cuda else None,
        "kernel_launches_per_step": round(launches / max(steps, 1), 1) if cuda else None,
        "device_us_per_step": round(busy * 1e6 / max(steps, 1), 1) if cuda else None,
        "wall_us_per_step": round(wall * 1e6 / max(steps, 1), 1),
        "top_kernels": [
            {"name": e.key[:80], "calls": e.count, "self_s": round(time_of(e) / 1e6, 4)} for e in ranked
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.profile_engine", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=16, help="device adapter slots (as bench_engine)")
    parser.add_argument("--base", action="store_true", help="no adapters (the base model's profile)")
    parser.add_argument("--kineto", action="store_true", help="device busy share under torch's profiler")
    parser.add_argument("--max-tokens", type=int, help="cap each request's output tokens (quick runs, tests)")
    add_switch(
        parser,
        "--cuda-graphs",
        "decode steps from CUDA graphs (auto: on a GPU); the category timers see only eager steps",
    )
    add_device_args(parser)
    args = parser.parse_args(argv)
    device, dtype = device_args(parser, args)
    bench = bench_model(args.model, args.adapters, args.requests)
    adapters = {} if args.base else bench.adapters
    graphs = SWITCH[args.cuda_graphs]
    engine = LLMEngine(
        bench.model_dir,
        EngineConfig(
            adapters=adapters,
            max_loras=args.max_loras,
            device=device,
            dtype=dtype,
            cuda_graphs=graphs,
            kv_prefault=True,  # as `loragate worker` runs it: no first writes of the pool in the steps
        ),
    )
    requests = capped(
        make_workload(bench.workload, engine.info.vocab_size, list(bench.adapters)), args.max_tokens
    )
    if args.base:
        requests = [replace(r, adapter=None) for r in requests]
    engine.generate(
        [replace(requests[0], request_id="warmup", params=replace(requests[0].params, max_tokens=4))]
    )
    head = {
        "model": args.model,
        "dtype": dtype_name(dtype),
        "device": device,
        "adapters": 0 if args.base else len(adapters),
        "requests": len(requests),
        "cuda_graphs": engine.graphs is not None,
        "host": host(),
    }
    if args.kineto:
        busy = busy_profile(engine, requests, is_cuda(device))
        print(json.dumps({**head, **busy, "graph_steps": engine.snapshot().graph_steps}))
        return 0
    timers = Timers(is_cuda(device))
    instrument(engine, timers)
    before = engine.snapshot()  # the warm-up request's steps are not the run's
    total, wall = run(engine, requests)
    after = engine.snapshot()
    seconds = {c: timers.seconds[c] for c in CATEGORIES}
    seconds["model_other"] = timers.seconds["forward"] - sum(seconds.values())
    seconds["step_other"] = wall - timers.seconds["forward"]
    result = {
        **head,
        "output_tokens": total,
        "tok_s": round(total / wall, 1),
        "wall_s": round(wall, 2),
        "steps": after.steps - before.steps,
        "graph_steps": after.graph_steps - before.graph_steps,
        "preemptions": after.preemptions - before.preemptions,
        # to the microsecond: a quick run's smallest category (a few steps' KV writes) is under a millisecond
        "seconds": {c: round(s, 6) for c, s in seconds.items()},
        "share": {c: round(s / wall, 3) for c, s in seconds.items()},
        "calls": {c: timers.calls[c] for c in (*CATEGORIES, "forward")},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
