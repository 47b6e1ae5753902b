"""Token log-probabilities in OpenAI's two shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions (the legacy shape lm-eval reads): `{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}`, where an echoed prompt's first token has `None` for its log-probability and its
top (nothing came before it to predict it from), and `text_offset` counts characters into the choice's text.
A token's text is the tokenizer's own piece for that one id (a piece that is part of a UTF-8 character
reads as U+FFFD; `bytes` then carries its exact bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loragate.types import TokenLogprob

TokenText = Callable[[int], tuple[str, list[int]]]  # token id -> (text, UTF-8 bytes)


@dataclass(frozen=True)
class Entry:
    """One token of a choice's text: its log-probability (None: the echoed prompt's first) and top."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None

    @staticmethod
    def of(lp: TokenLogprob) -> Entry:
        return Entry(lp.token_id, lp.logprob, lp.top)


def chat_logprobs(entries: list[Entry], token: TokenText) -> dict[str, Any]:
    content = []
    for e in entries:
        text, raw = token(e.token_id)
        top = [_chat_top(i, lp, token) for i, lp in e.top or ()]
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def _chat_top(token_id: int, logprob: float, token: TokenText) -> dict[str, Any]:
    text, raw = token(token_id)
    return {"token": text, "logprob": logprob, "bytes": raw}


def completion_logprobs(entries: list[Entry], token: TokenText, offset: int) -> tuple[dict[str, Any], int]:
    """The shape for `entries`, whose text starts `offset` characters into the choice; and the offset
    after them."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text, _ = token(e.token_id)
        tokens.append(text)
        logprobs.append(e.logprob)
        tops.append(None if e.top is None else {token(i)[0]: lp for i, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    shape = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
    return shape, offset
