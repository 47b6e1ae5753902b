"""Decode throughput with a JSON schema on every request vs none: the same batch, side by side in one run.

One engine, one batch of `--requests` requests (prompts asking for the four JSON documents of
`loadtest.bench_grammar`, each request guided by its document's schema), decoded twice per repeat,
interleaved (structured, free, structured, free, ...) after an untimed warm-up of both:
  - structured: every request carries its `json_schema` guide (compact JSON, enforced by xgrammar);
  - free: the same prompts without a guide, each capped (`max_tokens`, EOS ignored) at the number of
    tokens its structured twin decoded in the warm-up. Both runs thus decode as many tokens per request,
    with the same batch occupancy step by step: their tokens/s differ only by what the grammar costs.
Sampling is greedy, so every repeat decodes the same tokens. `structured_vs_free` is the ratio of the
medians over the repeats (target >= 0.8); `mask_us_per_step` is the host time of one step's mask (one
batch fill over all guided rows, then the apply), `accept_us_per_token` of advancing one matcher.
`finished` is the share of structured outputs that ended before `--max-tokens` (the rest are cut
mid-document), `valid_of_finished` the share of those that parse and validate against their schema.
The last line printed is one JSON object.

    python -m loadtest.bench_structured [--model smollm2|tiny] [--requests 32] [--max-tokens 128]
        [--repeats 3] [--threads N] [--device auto|cpu|cuda[:N]] [--dtype auto|float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from loadtest.bench_grammar import SCHEMAS
from loragate.guides import Guide, GuideKind
from loragate.stack_sources import checkpoint_dir
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.device import add_device_args, device_args, dtype_name
from worker.engine import LLMEngine

TOPICS = [
    "a person, with their name, age, email and a few tags",
    "the weather forecast of a city for the next three days",
    "the sentiment of a customer review, with a confidence and a one-line summary",
    "an order with its id, a few items (sku and quantity) and whether it is paid",
]


def prompt_ids(engine: LLMEngine, i: int) -> tuple[int, ...]:
    """A chat-style prompt (ChatML, as SmolLM2's template) asking for document `i % 4` as JSON."""
    schema = json.dumps(SCHEMAS[i % len(SCHEMAS)])
    text = (
        f"<|im_start|>user\nRequest {i}: answer with JSON only, describing {TOPICS[i % len(TOPICS)]}. "
        f"Schema: {schema}<|im_end|>\n<|im_start|>assistant\n"
    )
    return tuple(engine.tokenizer.encode(text, add_special_tokens=False).ids)


def structured_requests(engine: LLMEngine, n: int, max_tokens: int) -> list[Request]:
    return [
        Request(
            f"json-{i}",
            prompt_ids(engine, i),
            SamplingParams(
                max_tokens=max_tokens, guide=Guide(GuideKind.JSON_SCHEMA, SCHEMAS[i % len(SCHEMAS)]).to_json()
            ),
        )
        for i in range(n)
    ]


def run(engine: LLMEngine, requests: list[Request], bar: tqdm) -> tuple[float, dict[str, list[int]]]:
    """Decode `requests` to the end: (tokens/s, tokens per request)."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    start = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            bar.update(len(out.new_token_ids))
    elapsed = time.perf_counter() - start
    return sum(map(len, tokens.values())) / elapsed, tokens


def free_twins(structured: list[Request], lengths: dict[str, int], tag: str) -> list[Request]:
    """The same prompts without a guide, each decoding exactly as many tokens as its structured twin."""
    return [
        replace(
            r,
            request_id=f"{tag}-{r.request_id}",
            params=replace(r.params, guide="", max_tokens=lengths[r.request_id], ignore_eos=True),
        )
        for r in structured
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_structured", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 (pulled) or a zoo model (tiny, small)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch's default); 1 on a busy machine"
    )
    add_device_args(parser)
    args = parser.parse_args(argv)
    device, dtype = device_args(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(checkpoint_dir(args.model), EngineConfig(device=device, dtype=dtype))
    requests = structured_requests(engine, args.requests, args.max_tokens)

    per_run = args.requests * args.max_tokens  # an upper bound, for the bar
    with tqdm(
        total=2 * per_run * (args.repeats + 1), desc="structured vs free", unit="tok", file=sys.stderr
    ) as bar:
        # Warm-up: compiles the schemas, fills the prefix cache, and fixes each request's length.
        _, warm_tokens = run(engine, [replace(r, request_id=f"w-{r.request_id}") for r in requests], bar)
        lengths = {r.request_id: len(warm_tokens[f"w-{r.request_id}"]) for r in requests}
        run(engine, free_twins(requests, lengths, "w-free"), bar)
        structured: list[float] = []
        free: list[float] = []
        mask_s, mask_steps, accept_s, accepted = 0.0, 0, 0.0, 0
        last: dict[str, list[int]] = {}
        last_free: dict[str, list[int]] = {}
        for k in range(args.repeats):
            stats = replace(engine.grammar.stats)
            tok_s, last = run(engine, [replace(r, request_id=f"s{k}-{r.request_id}") for r in requests], bar)
            structured.append(tok_s)
            now = engine.grammar.stats
            mask_s += now.mask_seconds - stats.mask_seconds
            mask_steps += now.mask_steps - stats.mask_steps
            accept_s += now.accept_seconds - stats.accept_seconds
            accepted += now.accepted - stats.accepted
            tok_s, last_free = run(engine, free_twins(requests, lengths, f"f{k}"), bar)
            free.append(tok_s)

    outputs = {rid.split("-", 1)[1]: ids for rid, ids in last.items()}
    finished = [(i, r) for i, r in enumerate(requests) if len(outputs[r.request_id]) < args.max_tokens]
    valid = sum(_valid(engine.tokenizer.decode(outputs[r.request_id]), i) for i, r in finished)
    result = {
        "model": args.model,
        "device": device,
        "dtype": dtype_name(dtype),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "output_tokens": sum(map(len, last.values())),
        "free_output_tokens": sum(map(len, last_free.values())),
        "structured_tok_s": round(statistics.median(structured), 1),
        "free_tok_s": round(statistics.median(free), 1),
        "structured_vs_free": round(statistics.median(structured) / statistics.median(free), 3),
        "mask_us_per_step": round(mask_s / max(1, mask_steps) * 1e6, 1),
        "accept_us_per_token": round(accept_s / max(1, accepted) * 1e6, 2),
        "finished": round(len(finished) / len(requests), 3),
        "valid_of_finished": round(valid / max(1, len(finished)), 3),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return result


def _valid(text: str, i: int) -> bool:
    import jsonschema  # a test dependency: only the run's last check needs it

    try:
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    main()
