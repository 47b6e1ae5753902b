"""Per-decode-step cost of the logits processors (penalties and bias) at a long context.

`python -m loadtest.bench_processors [--rows 32] [--context 4200] [--vocab 49152] [--steps 30]
[--device cpu]` builds `rows` sequences of `context` prompt tokens with every penalty and a few biases on,
then times `process_logits` over `steps` decode steps (one new token appended per row per step, as the
engine does) and prints one JSON line: the mean milliseconds per step after a warm-up step.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from loragate.types import Request, SamplingParams
from worker.logits_processors import process_logits
from worker.sequence import Sequence


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=4200)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=4096,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        logit_bias=tuple((rng.randrange(args.vocab), 1.0) for _ in range(8)),
    )
    seqs = [
        Sequence.from_request(
            Request(f"r{i}", tuple(rng.randrange(args.vocab) for _ in range(args.context)), params)
        )
        for i in range(args.rows)
    ]
    logits = torch.randn(args.rows, args.vocab, device=args.device)
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        out = process_logits(logits, seqs, (0,))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for s, t in zip(seqs, out.argmax(dim=-1).tolist(), strict=True):
            s.token_ids.append(int(t))
    ms = sum(times[1:]) / args.steps * 1e3
    print(json.dumps({"rows": args.rows, "context": args.context, "vocab": args.vocab, "ms_per_step": ms}))


if __name__ == "__main__":
    main()
