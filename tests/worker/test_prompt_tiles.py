"""A bf16 request's rows attend by what they are, not by how the steps were cut: prompt rows on AMX tiles
where the CPU has them (`kernels/csrc/prefill_tiles.h`), generated rows on the decode kernel. So its
tokens and logprobs are the same bits whether its prompt came in one step or many, from the prefix cache
or not, and when it is resumed after some tokens (the generated ones then prefilled, as decode rows)."""

from __future__ import annotations

import pytest
import torch

from loragate.types import Request, RequestOutput, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

N = 12


def run(engine: LLMEngine, request: Request) -> tuple[list[int], list[float], int]:
    """The request's tokens, their logprobs and its cached prompt tokens."""
    engine.add_request(request)
    outs: list[RequestOutput] = []
    while engine.has_work():
        outs.extend(o for o in engine.step() if o.request_id == request.request_id)
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp.logprob for o in outs for lp in o.logprobs]
    return tokens, logprobs, outs[-1].cached_tokens


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_tokens_and_logprobs_keep_their_bits_chunked_cached_or_resumed(zoo: ZooPaths, model: str) -> None:
    params = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=0)
    prompt = tuple(range(40, 40 + 65))  # four 16-row tiles and one row

    def engine(budget: int = 2048) -> LLMEngine:
        config = EngineConfig(dtype=torch.bfloat16, max_num_batched_tokens=budget)
        return LLMEngine(zoo.base(model), config)

    whole = engine()
    tokens, logprobs, cached = run(whole, Request("whole", prompt, params))
    assert len(tokens) == N == len(logprobs) and cached == 0
    # the same prompt again: all but its last token from the cache, that one a chunk of its own
    again = run(whole, Request("again", prompt, params))
    assert again == (tokens, logprobs, 64)
    # the prompt in chunks of 16 tokens over five steps
    chunked = run(engine(budget=16), Request("chunked", prompt, params))
    assert chunked == (tokens, logprobs, 0)
    # resumed after k tokens: prompt and those k in one prefill, the k attending as their decode steps did
    for k in (1, 5, 11):
        resumed = Request(f"resumed{k}", prompt, params, resume_token_ids=tuple(tokens[:k]))
        got, got_logprobs, _ = run(engine(), resumed)
        assert (got, got_logprobs) == (tokens[k:], logprobs[k:]), k
