"""One request inside the engine: the checks it must pass to be added, what the engine keeps for it, and
what a step reports about it.

`check_request` refuses in `LLMEngine.add_request`, never mid-step, a request that could never run: an
empty prompt, token ids outside the vocabulary (in the prompt, `stop_token_ids` or `logit_bias`),
resumed tokens that already reach `max_tokens`, or a prompt plus `max_tokens` beyond the context length
or the whole KV pool. `track` makes the engine's state
for an accepted request (`Tracked`): its sequence, its sampling generator (seeded from the request's seed,
else at random; none when greedy), its incremental detokenizer, replayed over any resumed tokens so the
text continues right after what the client already has, its guide's grammar matcher if it has one, and
its prompt logprobs as they are computed, until they go out with its first output. `request_output` is
one step's report on it; `unstarted_abort` the same report for a request aborted before it was added (a
worker's, while its guide compiled).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loragate.types import FinishReason, Request, RequestOutput, TokenLogprob
from worker.detokenizer import DetokenizerState, IncrementalDetokenizer
from worker.engine_types import EngineInfo
from worker.sampler import generator_seed
from worker.sequence import Sequence

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher


@dataclass
class Tracked:
    seq: Sequence
    detok: DetokenizerState
    generator: torch.Generator | None
    matcher: GrammarMatcher | None = None  # its structured-output guide's state (worker.grammar)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    stop_token_ids: frozenset[int] = frozenset()  # the request's, for a membership test per token


def check_request(request: Request, info: EngineInfo, kv_blocks: int) -> None:
    """Raise ValueError, saying why, if `request` cannot run on an engine shaped by `info` whose KV pool
    holds `kv_blocks` blocks."""
    ids, max_tokens = request.prompt_token_ids, request.params.max_tokens
    if not ids:
        raise ValueError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {info.vocab_size})")
    p = request.params
    for name, tokens in (("stop_token_ids", p.stop_token_ids), ("logit_bias", [t for t, _ in p.logit_bias])):
        if any(not 0 <= t < info.vocab_size for t in tokens):
            raise ValueError(f"{name}: token ids must be in [0, {info.vocab_size})")
    if len(request.resume_token_ids) >= max_tokens:
        raise ValueError("nothing left to generate: the resumed tokens already reach max_tokens")
    total = len(ids) + max_tokens
    if total > info.max_model_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"the model's context length of {info.max_model_len} tokens"
        )
    if -(-total // info.block_size) > kv_blocks:
        raise ValueError(
            f"request needs {total} tokens of KV but the pool holds {kv_blocks * info.block_size}"
        )


def track(
    request: Request,
    detokenizer: IncrementalDetokenizer,
    device: str,
    matcher: GrammarMatcher | None = None,
) -> Tracked:
    """The engine's state for a request it accepted (`matcher`: its guide's, from `worker.grammar`)."""
    p = request.params
    generator = None
    if not p.greedy:
        seed = generator_seed(p.seed) if p.seed is not None else secrets.randbits(64)
        generator = torch.Generator(device=device).manual_seed(seed)
    detok = DetokenizerState.start(request.prompt_token_ids, p.stop, p.skip_special_tokens)
    if request.resume_token_ids:
        # Replay what the previous worker generated, then continue after the text it streamed.
        for n in range(1, len(request.resume_token_ids) + 1):
            detokenizer.update(detok, list(request.resume_token_ids[:n]))
        detok.emitted = min(len(request.resume_text), len(detok.text))
    return Tracked(
        Sequence.from_request(request), detok, generator, matcher, stop_token_ids=frozenset(p.stop_token_ids)
    )


def request_output(
    t: Tracked, new_ids: list[int], text: str, logprobs: tuple[TokenLogprob, ...] = ()
) -> RequestOutput:
    """What one step reports about a request: its new tokens and text (with their logprobs, if asked),
    where it stands, and with its first output its prompt logprobs (if asked)."""
    seq = t.seq
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    if not t.prompt_logprobs_sent and not seq.wants_prompt_logits:  # never a partial list (an abort)
        prompt_logprobs, t.prompt_logprobs_sent = tuple(t.prompt_logprobs), True
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=tuple(new_ids),
        text_delta=text,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_output_tokens,
        cached_tokens=seq.num_cached_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def unstarted_abort(request: Request) -> RequestOutput:
    """The final output of `request` aborted before it was added to the engine: what the engine reports
    for one it aborts before its first step."""
    seq = Sequence.from_request(request)
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=(),
        text_delta="",
        finished=True,
        finish_reason=FinishReason.ABORT,
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_output_tokens,
        cached_tokens=seq.num_cached_tokens,
    )
