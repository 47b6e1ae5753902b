"""Engine throughput, side by side in one run: loragate vs transformers(+peft), with adapters and without.

The same model and the same requests (`loadtest.bench_models`: for the zoo models shared system prompts,
prompts 32–512 tokens, 64–256 output tokens, 16 adapters with Zipf popularity plus base requests; for the
real SmolLM2, 8 adapters of ranks 8/16 and prompts 20–200 tokens) go through:
  1. the loragate engine, continuous batching, all adapters in one batch;
  2. `transformers` + `peft` `generate` on static batches with a mixed `adapter_names` list;
  3. the loragate engine with every request's adapter removed (base-only);
  4. `transformers`' own `generate` of the base model (no peft) on the same static batches, base-only.
Output tokens are what each request asked for (greedy, EOS ignored); HF's static batches run to their
longest member, and the extra tokens are not counted. `tokens_match` checks the engine's greedy tokens
against a per-request HF+peft reference on a sample. The last line printed is one JSON object.

    python -m loadtest.bench_engine [--model tiny|small|smollm2] [--requests 128] [--hf-batch-size 32]
        [--max-num-seqs 128] [--max-tokens N] [--device auto|cpu|cuda[:N]]
        [--dtype auto|float32|bfloat16|float16]

`--max-tokens N` caps each request's output tokens (quick runs, tests: the same prompts and adapters).

`--rounds N` times each loragate engine N times, alternated ABBA (figures: each one's median run); then
both serve the workload at once, a step of each in turn, each timed on its own steps
(`interleaved_lora_vs_base_ratio`: the LoRA/base ratio least moved by a machine whose speed drifts).
Both sides run on the same device and dtype, which the JSON records. In 16-bit the two accumulate in
different orders, so `tokens_match` may be false there without either being wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from tqdm import tqdm

from kernels.triton_variants import compiled_keys, total_variants
from loadtest.bench_models import bench_model, run_header
from loadtest.host import host
from loadtest.workload import capped, make_workload
from loragate.types import Request, RequestOutput
from worker.config import EngineConfig
from worker.device import SWITCH, add_device_args, add_switch, device_args
from worker.engine import LLMEngine

if TYPE_CHECKING:
    from loadtest.hf_reference import HFReference


@dataclass(frozen=True)
class EngineRun:
    """One timed engine run: throughput, each request's tokens, and what separates start-up from steady
    state (a GPU's first steps may compile kernels): the rate between the 10 % and 90 % token marks and
    the longest step."""

    tok_s: float
    tokens: list[list[int]]
    steady_tok_s: float
    slowest_step_ms: float


class Stepped(Protocol):
    """What `run_interleaved` drives: an `LLMEngine`, or a wrapper around one."""

    def add_request(self, request: Request) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...


def run_interleaved(runs: Sequence[tuple[Stepped, list[Request]]], label: str) -> list[EngineRun]:
    """The engines serve their workloads at once, one step each in turn: each one's figures count only its
    own steps' time, so a machine whose speed drifts (this one's moves by a third within an hour) slows
    both alike and their ratio stays put. The turn order reverses every round (A B, B A, A B, ...): with
    one fixed order, the engine that went first measured ~2.5 % slower (two identical-speed paths, tiny
    fp32: 0.989-0.993 first, 1.037-1.04 second), so each engine now follows each of the others alike."""
    clocks = [0.0] * len(runs)  # each engine's own time so far
    tokens: list[dict[str, list[int]]] = []
    marks: list[list[tuple[float, int]]] = [[] for _ in runs]
    done, slowest = [0] * len(runs), [0.0] * len(runs)
    for engine, requests in runs:
        for r in requests:
            engine.add_request(r)
        tokens.append({r.request_id: [] for r in requests})
    total = sum(r.params.max_tokens for _, requests in runs for r in requests)
    with tqdm(total=total, desc=label, unit="tok", file=sys.stderr) as bar:
        order = list(enumerate(runs))
        while any(engine.has_work() for engine, _ in runs):
            for i, (engine, _) in order:
                if not engine.has_work():
                    continue
                start = time.perf_counter()
                outs = engine.step()
                took = time.perf_counter() - start
                for out in outs:
                    tokens[i][out.request_id].extend(out.new_token_ids)
                    done[i] += len(out.new_token_ids)
                    bar.update(len(out.new_token_ids))
                clocks[i] += took
                slowest[i] = max(slowest[i], took)
                marks[i].append((clocks[i], done[i]))
            order.reverse()
    return [
        EngineRun(
            sum(r.params.max_tokens for r in requests) / clocks[i],
            [tokens[i][r.request_id] for r in requests],
            steady_rate(marks[i]),
            slowest[i] * 1e3,
        )
        for i, (_, requests) in enumerate(runs)
    ]


def run_loragate(engine: LLMEngine, requests: list[Request], label: str) -> EngineRun:
    """One engine alone through `requests` (`run_interleaved` with nothing beside it)."""
    return run_interleaved([(engine, requests)], label)[0]


def rounds(n: int) -> list[str]:
    """The order of the loragate runs: LoRA, base, then base, LoRA, ... (n of each)."""
    order: list[str] = []
    for i in range(n):
        order += ["LoRA", "base"] if i % 2 == 0 else ["base", "LoRA"]
    return order


def median_run(runs: list[EngineRun]) -> EngineRun:
    """The run with the median throughput (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r.tok_s)[(len(runs) - 1) // 2]


def steady_rate(marks: list[tuple[float, int]], lo: float = 0.1, hi: float = 0.9) -> float:
    """Tokens per second between the first steps at which `lo` and `hi` of the tokens were out."""
    total = marks[-1][1] if marks else 0
    first = next(((t, n) for t, n in marks if n >= lo * total), None)
    last = next(((t, n) for t, n in marks if n >= hi * total), None)
    if first is None or last is None or last[0] <= first[0]:
        return 0.0
    return (last[1] - first[1]) / (last[0] - first[0])


def run_hf(
    ref: HFReference, requests: list[Request], batch_size: int, pad_id: int, label: str = "transformers+peft"
) -> float:
    """Static batches through `generate`: with each request's adapter when `ref` holds adapters (peft's
    mixed `adapter_names`), else the plain transformers model."""
    from peft import PeftModel

    total = sum(r.params.max_tokens for r in requests)
    model = ref.model
    mixed = isinstance(model, PeftModel)
    start = time.perf_counter()
    with tqdm(total=total, desc=label, unit="tok", file=sys.stderr) as bar:
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):  # left padding
                ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - len(r.prompt_token_ids) :] = 1
            new = max(r.params.max_tokens for r in batch)
            adapters = {"adapter_names": [r.adapter or "__base__" for r in batch]} if mixed else {}
            with torch.inference_mode():
                model.generate(
                    input_ids=ids.to(ref.device),
                    attention_mask=mask.to(ref.device),
                    **adapters,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            bar.update(sum(r.params.max_tokens for r in batch))
    return total / (time.perf_counter() - start)


def warm_up(engine: LLMEngine, requests: list[Request], n: int = 24) -> None:
    """A few steps of the workload's first `n` requests, off the clock: the batch shapes and adapter
    mixes of a real run, so that a GPU's Triton kernels are compiled (and a CPU's caches warm) before
    the timed run, as a serving worker's are after its first requests. Their prompts are reversed, so
    the timed run finds none of them in the prefix cache."""
    engine.generate(
        [
            replace(
                r,
                request_id=f"warmup-{i}",
                prompt_token_ids=tuple(reversed(r.prompt_token_ids)),
                params=replace(r.params, max_tokens=4),
            )
            for i, r in enumerate(requests[:n])
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_engine", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument(
        "--adapters", type=int, default=16, help="distinct adapter names (zoo models: their adapters reused)"
    )
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--check-sample", type=int, default=6, help="requests compared with HF+peft")
    parser.add_argument("--max-tokens", type=int, help="cap each request's output tokens (quick runs, tests)")
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument(
        "--max-num-seqs", type=int, default=EngineConfig().max_num_seqs, help="the engines' running-batch cap"
    )
    parser.add_argument("--skip-hf", action="store_true", help="loragate only (hf figures are null)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timed runs of each loragate engine, alternated ABBA; figures are each engine's median run",
    )
    add_switch(parser, "--warmup", "the engine's own warm-up (worker.warmup; auto: on a GPU)")
    add_switch(
        parser,
        "--cuda-graphs",
        "replay whole-decode steps from CUDA graphs (worker.decode_graphs; auto: on a GPU)",
    )
    add_device_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    device, dtype = device_args(parser, args)

    bench = bench_model(args.model, args.adapters, args.requests)
    model_dir, adapters = bench.model_dir, bench.adapters
    warmup = SWITCH[args.warmup]
    config = EngineConfig(
        adapters=adapters,
        max_loras=args.max_loras,
        max_num_seqs=args.max_num_seqs,
        device=device,
        dtype=dtype,
        warmup=warmup,
        cuda_graphs=SWITCH[args.cuda_graphs],
        kv_prefault=True,  # as `loragate worker` runs it
    )
    compiled = [total_variants()]
    engine = LLMEngine(model_dir, config)
    compiled.append(total_variants())
    after_warmup = compiled_keys()
    requests = capped(make_workload(bench.workload, engine.info.vocab_size, list(adapters)), args.max_tokens)
    base_engine = LLMEngine(model_dir, replace(config, adapters={}))
    base_requests = [replace(r, adapter=None) for r in requests]
    lora_runs: list[EngineRun] = []
    base_runs: list[EngineRun] = []
    for label in rounds(args.rounds):  # ABBA: on a noisy machine neither engine always goes first
        runs, eng, work = (
            (lora_runs, engine, requests) if label == "LoRA" else (base_runs, base_engine, base_requests)
        )
        eng.reset_state()  # each round from an empty prefix cache, then the reversed-prompt warm-up
        warm_up(eng, work)
        runs.append(run_loragate(eng, work, f"loragate ({label}, round {len(runs) + 1}/{args.rounds})"))
        if label == "LoRA" and len(runs) == 1:
            stats, graph_steps = engine.snapshot(), engine.stats.graph_steps
    for eng, work in ((engine, requests), (base_engine, base_requests)):
        eng.reset_state()
        warm_up(eng, work)
    lora_mixed, base_mixed = run_interleaved(
        [(engine, requests), (base_engine, base_requests)], "loragate (LoRA and base, step by step)"
    )
    lora_run, base_run = median_run(lora_runs), median_run(base_runs)
    lora_tok_s, lora_tokens, base_tok_s = lora_run.tok_s, lora_runs[0].tokens, base_run.tok_s
    hit_rate = stats.prefix_hit_tokens / max(1, stats.prefix_queried_tokens)
    compiled.append(total_variants())
    for kernel, keys in compiled_keys().items():  # what the warm-up missed, for whoever extends it
        for key in sorted(keys - after_warmup.get(kernel, set())):
            print(f"compiled after the warm-up: {kernel} {key}", file=sys.stderr)

    # transformers and peft only here: the modules that reuse this one's runs (`bench_serve`, `bench_vllm`,
    # `lora_cost`) do not wait ~8 s for their imports.
    from loadtest.hf_reference import HFReference

    hf_tok_s = hf_base_tok_s = None
    ref = HFReference(model_dir, adapters, dtype=dtype, device=device)
    if not args.skip_hf:
        hf_tok_s = run_hf(ref, requests, args.hf_batch_size, pad_id=0)
        plain = HFReference(model_dir, {}, dtype=dtype, device=device)
        hf_base_tok_s = run_hf(plain, base_requests, args.hf_batch_size, 0, "transformers (base only)")
        del plain
    sample = requests[:: max(1, len(requests) // args.check_sample)][: args.check_sample]
    index = {r.request_id: i for i, r in enumerate(requests)}
    matches = [
        ref.greedy(list(r.prompt_token_ids), r.params.max_tokens, r.adapter)
        == lora_tokens[index[r.request_id]]
        for r in tqdm(sample, desc="reference check", file=sys.stderr)
    ]
    graphs = engine.graphs.report if engine.graphs else None
    result = {
        **run_header(args.model, device, dtype, requests),
        "adapters": len(adapters),
        "hf_batch_size": args.hf_batch_size,
        "loragate_tok_s": round(lora_tok_s, 1),
        "loragate_base_tok_s": round(base_tok_s, 1),
        "hf_peft_tok_s": round(hf_tok_s, 1) if hf_tok_s else None,
        "speedup_vs_hf_peft": round(lora_tok_s / hf_tok_s, 2) if hf_tok_s else None,
        "hf_base_tok_s": round(hf_base_tok_s, 1) if hf_base_tok_s else None,
        "base_vs_hf_base": round(base_tok_s / hf_base_tok_s, 2) if hf_base_tok_s else None,
        "lora_vs_base_ratio": round(lora_tok_s / base_tok_s, 3),
        "rounds": args.rounds,
        "loragate_tok_s_rounds": [round(r.tok_s, 1) for r in lora_runs],
        "loragate_base_tok_s_rounds": [round(r.tok_s, 1) for r in base_runs],
        # Greedy decoding is deterministic: every round of an engine must give the same tokens.
        "tokens_stable_across_rounds": all(r.tokens == lora_runs[0].tokens for r in [*lora_runs, lora_mixed])
        and all(r.tokens == base_runs[0].tokens for r in [*base_runs, base_mixed]),
        # Both engines in one run, a step of each in turn, each timed on its own steps (`run_interleaved`):
        # the LoRA/base ratio least moved by this machine's drifting speed.
        "loragate_interleaved_tok_s": round(lora_mixed.tok_s, 1),
        "loragate_base_interleaved_tok_s": round(base_mixed.tok_s, 1),
        "interleaved_lora_vs_base_ratio": round(lora_mixed.tok_s / base_mixed.tok_s, 3),
        "loragate_steady_tok_s": round(lora_run.steady_tok_s, 1),
        "loragate_base_steady_tok_s": round(base_run.steady_tok_s, 1),
        "steady_lora_vs_base_ratio": round(lora_run.steady_tok_s / max(base_run.steady_tok_s, 1e-9), 3),
        "slowest_step_ms": round(lora_run.slowest_step_ms, 1),
        "base_slowest_step_ms": round(base_run.slowest_step_ms, 1),
        "tokens_match": all(matches),
        "tokens_checked_requests": len(matches),
        "prefix_hit_rate": round(hit_rate, 3),
        "preemptions": stats.preemptions,
        "engine_steps": stats.steps,
        "threads": torch.get_num_threads(),
        "max_num_seqs": config.max_num_seqs,
        # The engines' warm-ups (LoRA engine's figures); the Triton variants compiled by the first engine's
        # warm-up and by everything after it (both engines' request warm-ups and runs: 0 = the warm-up
        # covered every shape the workload met).
        "warmup_s": round(engine.warmup.seconds, 2) if engine.warmup else None,
        "warmup_steps": engine.warmup.steps if engine.warmup else None,
        "kernels_compiled_in_warmup": compiled[1] - compiled[0],
        "kernels_compiled_after_warmup": compiled[2] - compiled[1],
        # Whole-decode steps replayed from CUDA graphs (worker.decode_graphs), in the LoRA engine's first run.
        "cuda_graphs": engine.graphs is not None,
        "graphs_captured": graphs.graphs if graphs else 0,
        "graph_capture_s": round(graphs.seconds, 2) if graphs else None,
        "graph_steps": graph_steps,
        "host": host(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
