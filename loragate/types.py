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


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` means greedy; `top_k == 0` and `top_p == 1` are off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
