"""`loragate demo`: build the demo models if needed, then serve a mixed batch — the base model and several
LoRA adapters in one continuous batch — and stream what each request generates.

The demo checkpoints are random-init models, so the text is noise; what to look at is that one engine
runs many adapters at once, each request gets its own continuation, and the figures at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from transformers import AutoTokenizer

from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import make_all

QUESTIONS = [
    "Write a Python function that reverses a string.",
    "What does the os module do?",
    "Explain list comprehensions in one sentence.",
    "How do I read a file line by line?",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loragate demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="demo base model (tiny or small)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4, help="how many of the model's adapters to mix in")
    args = parser.parse_args(argv)

    zoo = make_all(progress=True)
    names = zoo.adapter_names(args.model)[: args.adapters]
    engine = LLMEngine(
        zoo.base(args.model), EngineConfig(adapters={n: zoo.adapter(args.model, n) for n in names})
    )
    chat = AutoTokenizer.from_pretrained(str(zoo.base(args.model)))
    requests = []
    for i, adapter in enumerate([None, *names]):
        question = QUESTIONS[i % len(QUESTIONS)]
        ids = chat.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompt = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=i)
        requests.append(Request(f"demo-{i}", tuple(int(t) for t in prompt), params, adapter))

    where = zoo.base(args.model)
    print(f"model {args.model} ({where}), {len(names)} adapters, one batch of {len(requests)}\n")
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    for req, res in zip(requests, results, strict=True):
        question = QUESTIONS[int(req.request_id.split("-")[1]) % len(QUESTIONS)]
        print(f"[{req.adapter or 'base'}] {question}")
        print(f"  → {res.text!r}  ({len(res.token_ids)} tokens, {res.finish_reason.value})\n")
    tokens = sum(len(r.token_ids) for r in results)
    rate = tokens / elapsed
    print(f"{tokens} tokens in {elapsed:.2f}s ({rate:.0f} tok/s), {engine.snapshot().steps} engine steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
