"""Typed values that cross process boundaries (gateway ↔ worker) or the engine's public API.

Torch-free on purpose: the gateway builds and reads these too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller


MAX_LOGPROBS = 20  # top log-probabilities per token, at most (OpenAI's chat limit)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` means greedy; `top_k == 0`, `top_p == 1`, `min_p == 0`,
    penalties 0 (presence, frequency) or 1 (repetition) are off.

    - `presence_penalty` / `frequency_penalty` (OpenAI's): subtracted from the logit of every token already
      in the output, once / once per occurrence. `repetition_penalty` (CTRL's, as transformers and vLLM):
      the logit of every token in the prompt or output is divided by it when positive, multiplied when not.
    - `logit_bias`: (token id, bias) pairs added to the logits before sampling (OpenAI's, -100..100).
    - `min_tokens`: EOS and `stop_token_ids` cannot be sampled before this many output tokens.
    - `min_p`: drop tokens whose probability is below `min_p` times the top token's.
    - `logprobs`: report the sampled token's log-probability and this many top alternatives (0..20) for
      each output token; None = none. `prompt_logprobs`: the same for each prompt token (its first has
      none), for `echo`; the prompt is then computed afresh (no prefix-cache hit), as its logits are needed.
      Log-probabilities are the model's own (log-softmax of the raw logits, before temperature, penalties,
      bias or a grammar), as vLLM reports them.
    - `guide`: a structured-output constraint, `loragate.guides.Guide.to_json()`; "" = none.
    - `skip_special_tokens`: special tokens (control tokens such as `[TOOL_CALLS]`) are left out of the
      text, as vLLM's default; False keeps them (a tool-call format whose marker is one needs them).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guide: str = ""
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Any penalty on (they read the tokens seen so far)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability and the top alternatives at its position (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request as the engine receives it: already tokenized, adapter by name."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Continuing a request another worker started (it died): the tokens it generated and the text it
    # streamed. They count as this request's output: generation, max_tokens and detokenization go on
    # exactly where they stopped, so the client's text continues seamlessly.
    resume_token_ids: tuple[int, ...] = ()
    resume_text: str = ""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step produced for one request: a delta, plus the totals so far."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked for them
    # Once, with the request's first output, when it asked for prompt logprobs: one per prompt token
    # after the first (which has no context to be predicted from).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
