"""The offline engine's greedy reference texts, generated in the test process on one CPU thread.

The stack's workers run beside the test process, one or two threads each on a two-core machine; an
offline engine on torch's default pool (every core) then spins its OpenMP threads against theirs and
against whatever else runs: 600 greedy tokens of `tiny` took 54 s on two threads and 8.6 s on one on a
loaded two-core host. The texts do not depend on the thread count (greedy, the same checkpoint).

A request continued after an abort (or a dead worker) is prefilled again with the tokens already streamed:
its next token comes from a prefill's logits where the undisturbed run had a decode step's, fp32 sums taken
in another order, and two near-tied tokens can swap (`tiny`, "class LRUCache:..." cut after 108 of 600
tokens: the continuation differs from there on). `continued` is the reference for such a request.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from loragate.types import Request, SamplingParams
from worker.engine import LLMEngine


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op pool at one thread for the block, then as it was (other tests share the process)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def resume_cuts(workdir: Path, request_id: str) -> list[int]:
    """How many streamed tokens each continuation of `request_id` (its scoped id) started after, as the
    stack's workers logged them, in order."""
    pattern = re.compile(rf"resuming {re.escape(request_id)} after (\d+) streamed tokens")
    logs = "".join(p.read_text() for p in workdir.glob("*.log"))
    return sorted({int(m) for m in pattern.findall(logs)})


def continued(engine: LLMEngine, prompt: str, params: SamplingParams, cuts: list[int]) -> str:
    """The greedy text of `prompt` continued after each of `cuts` tokens, as a worker continues it: the
    prompt and the tokens so far prefilled again (`resume_token_ids`), then decoded."""
    ids = tuple(engine.tokenizer.encode(prompt, add_special_tokens=False).ids)
    tokens: list[int] = []
    text = ""
    for cut in [0, *cuts]:
        request = Request(
            f"continued-{cut}-{time.monotonic_ns()}", ids, params, resume_token_ids=tuple(tokens[:cut])
        )
        with one_thread():
            out = engine.generate([request])[0]
        tokens, text = tokens[:cut] + list(out.token_ids), out.text
    return text
