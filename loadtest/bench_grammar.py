"""Grammar engines side by side: xgrammar vs llguidance, per-step token-mask cost at batch 32.

Each of the batch's sequences follows a real JSON document of its own schema (four schemas: nested
objects, enums, arrays, numbers, free strings), token by token, as a decoder constrained by that schema
would: every step computes all 32 next-token masks over the model's vocabulary (SmolLM2's 49,152 tokens by
default), then advances each matcher by its document's next token. Timed per step, after a warm-up pass:
  - `llguidance_serial_us`: `LLMatcher.compute_bitmask`-equivalent fills, one matcher after another;
  - `llguidance_par_us`: `fill_next_token_bitmask_par` (its Rust thread pool) for the whole batch;
  - `xgrammar_serial_us` / `xgrammar_batch_us`: `GrammarMatcher.fill_next_token_bitmask` one by one, and
    `BatchGrammarMatcher.batch_fill_next_token_bitmask` (its thread pool);
plus each engine's compile time for the four schemas (cold) and the cost of applying the masks to the
`[32, V]` logits on the CPU: llguidance's torch code (`apply_mask_us`, random masks), and on each step's
real masks xgrammar's CPU kernel (`xgrammar_apply_cpu_us`, with a copy of the logits) and the worker's
numpy + `torch.where` (`xgrammar_worker_apply_us`, `worker.grammar`). The last line printed is one JSON
object.

    python -m loadtest.bench_grammar [--model smollm2|tiny] [--batch 32] [--steps 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "email", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "forecast": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"day": {"type": "string"}, "temp": {"type": "number"}},
                    "required": ["day", "temp"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["city", "unit", "forecast"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number"},
            "summary": {"type": "string"},
        },
        "required": ["sentiment", "confidence", "summary"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["order_id", "items", "paid"],
        "additionalProperties": False,
    },
]

DOCS: list[str] = [
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"]}',
    '{"city": "Lisbon", "unit": "celsius", "forecast": [{"day": "Mon", "temp": 21.5}, '
    '{"day": "Tue", "temp": 19}, {"day": "Wed", "temp": 23.25}]}',
    '{"sentiment": "positive", "confidence": 0.93, "summary": "The customer liked the fast delivery '
    'and the friendly support, and will order again."}',
    '{"order_id": 48213, "items": [{"sku": "A-100", "qty": 2}, {"sku": "B-7", "qty": 1}, '
    '{"sku": "C-42", "qty": 12}], "paid": true}',
]


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def _each(fill: Any, live: list[tuple[Any, int]], mask: torch.Tensor) -> None:
    for matcher, row in live:
        fill(matcher, mask, row)


def bench_llguidance(
    tok_json: str, vocab: int, eos: int, docs: list[list[int]], batch: int
) -> dict[str, Any]:
    import llguidance
    import llguidance.torch as lgt

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    grammars = [llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)) for s in SCHEMAS]
    first = [llguidance.LLMatcher(tokenizer, g) for g in grammars]  # compiles lazily: time the first
    compile_s = time.perf_counter() - start
    assert not any(m.is_error() for m in first), [m.get_error() for m in first]
    executor = llguidance.LLExecutor()
    mask = lgt.allocate_token_bitmask(batch, vocab)
    serial: list[float] = []
    par: list[float] = []
    for rnd in range(2):  # round 0 warms up
        matchers = [llguidance.LLMatcher(tokenizer, grammars[i % len(grammars)]) for i in range(batch)]
        for step in range(max(len(d) for d in docs)):
            live = [(m, i) for i, m in enumerate(matchers) if step < len(docs[i % len(docs)])]
            t_serial = _timed(lambda live=live: _each(lgt.fill_next_token_bitmask, live, mask))
            t_par = _timed(lambda live=live: lgt.fill_next_token_bitmask_par(executor, live, mask))
            if rnd and len(live) == batch:
                serial.append(t_serial)
                par.append(t_par)
            for m, i in live:
                ok = m.consume_token(docs[i % len(docs)][step])
                assert ok and not m.is_error(), m.get_error()
    return {
        "tokenizer_s": round(tokenizer_s, 3),
        "compile_ms": round(compile_s * 1e3, 2),
        "serial_us": round(statistics.median(serial), 1),
        "par_us": round(statistics.median(par), 1),
        "steps": len(serial),
    }


def bench_xgrammar(tokenizer_dir: Path, vocab: int, docs: list[list[int]], batch: int) -> dict[str, Any]:
    import transformers
    import xgrammar as xgr

    start = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = [compiler.compile_json_schema(json.dumps(s)) for s in SCHEMAS]
    compile_s = time.perf_counter() - start
    batcher = xgr.BatchGrammarMatcher()
    mask = xgr.allocate_token_bitmask(batch, vocab)
    serial: list[float] = []
    batched: list[float] = []
    applied: list[tuple[float, float]] = []
    for rnd in range(2):
        matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(batch)]
        for step in range(max(len(d) for d in docs)):
            live = [i for i in range(batch) if step < len(docs[i % len(docs)])]
            t_serial = _timed(
                lambda ms=matchers, live=live: [ms[i].fill_next_token_bitmask(mask, i) for i in live]
            )
            t_batch = _timed(
                lambda ms=matchers, live=live: batcher.batch_fill_next_token_bitmask(
                    [ms[i] for i in live], mask, live
                )
            )
            if rnd and len(live) == batch:
                serial.append(t_serial)
                batched.append(t_batch)
            if rnd and len(live) == batch:
                applied.append(_apply_costs(mask, vocab))
            for i in live:
                assert matchers[i].accept_token(docs[i % len(docs)][step])
    return {
        "apply_cpu_us": round(statistics.median(a for a, _ in applied), 1),
        "worker_apply_us": round(statistics.median(w for _, w in applied), 1),
        "tokenizer_s": round(tokenizer_s, 3),
        "compile_ms": round(compile_s * 1e3, 2),
        "serial_us": round(statistics.median(serial), 1),
        "batch_us": round(statistics.median(batched), 1),
        "steps": len(serial),
    }


def _apply_costs(mask: torch.Tensor, vocab: int) -> tuple[float, float]:
    """This step's real masks applied to `[batch, V]` logits on the CPU: by xgrammar's CPU kernel, and by
    the worker's (`worker.grammar`)."""
    import xgrammar as xgr

    from worker.grammar import _apply_on_host

    logits = torch.randn(mask.shape[0], vocab)
    rows = list(range(mask.shape[0]))
    kernel = _timed(lambda: xgr.apply_token_bitmask_inplace(logits.clone(), mask, vocab_size=vocab))
    worker = _timed(lambda: _apply_on_host(logits, mask, rows))
    return kernel, worker


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from loragate.stack_sources import checkpoint_dir

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 (pulled) or a zoo model (tiny, small)")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    model_dir = checkpoint_dir(args.model)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    eos = config.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else int(eos)
    docs = [tok.encode(d, add_special_tokens=False).ids for d in DOCS]
    for d in DOCS:
        json.loads(d)
    results: dict[str, Any] = {"model": args.model, "vocab_size": vocab, "batch": args.batch}
    with tqdm(total=3, desc="grammar engines", disable=None) as bar:
        lg = bench_llguidance(tok.to_str(), vocab, eos, docs, args.batch)
        bar.update()
        xg = bench_xgrammar(model_dir, vocab, docs, args.batch)
        bar.update()
        logits = torch.randn(args.batch, vocab)
        import llguidance.torch as lgt

        mask = lgt.allocate_token_bitmask(args.batch, vocab)
        apply_us = statistics.median(
            _timed(lambda: lgt.apply_token_bitmask_inplace(logits, mask)) for _ in range(50)
        )
        bar.update()
    results.update({f"llguidance_{k}": v for k, v in lg.items()})
    results.update({f"xgrammar_{k}": v for k, v in xg.items()})
    results["apply_mask_us"] = round(apply_us, 1)
    results["llguidance_per_token_us"] = round(min(lg["serial_us"], lg["par_us"]) / args.batch, 2)
    results["xgrammar_per_token_us"] = round(min(xg["serial_us"], xg["batch_us"]) / args.batch, 2)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
