"""A request's mutable state inside the engine, owned by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from loragate.types import FinishReason, Request

if TYPE_CHECKING:
    from worker.logits_processors import RequestLogitsState


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """Token ids are prompt + output. KV holds `num_computed_tokens` of them; the rest are computed next.

    A decode step computes exactly the last sampled token; a (chunked) prefill computes a run of them. When
    a step's tokens reach the end of `token_ids`, the step samples the next token.
    """

    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at (last) admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, chained (loragate.hashing)
    num_registered_blocks: int = 0  # leading blocks already published to the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    lora_slot: int = -1
    # The first prompt position whose logits (for prompt logprobs) are still to be computed; none are
    # wanted from `num_prompt_tokens - 1` on (that position's logits sample the first output token).
    next_prompt_logit: int = 0
    # Its logits processors' device state (penalty counts, bias ids), made at first use.
    logits_state: RequestLogitsState | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_request(cls, request: Request) -> Sequence:
        n = len(request.prompt_token_ids)
        # A resumed request's prompt logprobs went out with its first output, on the worker that began it.
        wanted = request.params.prompt_logprobs is not None and not request.resume_token_ids
        return cls(
            request=request,
            token_ids=[*request.prompt_token_ids, *request.resume_token_ids],
            num_prompt_tokens=n,
            next_prompt_logit=0 if wanted else max(0, n - 1),
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logits(self) -> bool:
        """Some prompt positions' logits are still needed: they must be computed, not taken from cache."""
        return self.next_prompt_logit < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
