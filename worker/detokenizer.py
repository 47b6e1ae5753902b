"""Incremental detokenization with stop strings, for streaming text deltas.

Text of new tokens is `decode(ids[prefix:]) - decode(ids[prefix:read])`: decoding with a little context
keeps word-boundary spaces right for SentencePiece-style tokenizers, and the delta is released only when
it does not end in a replacement character (byte-level BPE tokens may end inside a UTF-8 character).
With stop strings, the last `len(longest stop) - 1` characters are held back until the request ends, so
no delta ever carries the start of a stop string that a later token completes. On a match the text is
cut before the stop string.

A request may carry many stop strings, so their cost per token must not grow with their number: the
state keeps them deduplicated, their longest length computed once, and (beyond a few) one compiled
alternation that finds the earliest match of any of them in a single pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenizers import Tokenizer

_CONTEXT_TOKENS = 5
_FIND_AT_MOST = 4  # up to this many stop strings, `str.find` each beats a regex


@dataclass
class DetokenizerState:
    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)  # a few prompt tokens of context, then the output
    prefix_offset: int = 0
    read_offset: int = 0
    consumed: int = 0  # output tokens appended to `ids`
    text: str = ""  # decoded output text so far
    emitted: int = 0  # characters of `text` already returned as deltas
    longest_stop: int = 0  # length of the longest stop string
    pattern: re.Pattern[str] | None = None  # all stop strings as one alternation, when there are many
    skip_special: bool = True  # special tokens are left out of the text

    @classmethod
    def start(
        cls, prompt_ids: list[int] | tuple[int, ...], stop: tuple[str, ...], skip_special: bool = True
    ) -> DetokenizerState:
        tail = list(prompt_ids[-_CONTEXT_TOKENS:])
        # Longest first: at the earliest position the longest alternative wins (the cut is the same).
        unique = tuple(sorted(dict.fromkeys(stop), key=len, reverse=True))
        pattern = re.compile("|".join(map(re.escape, unique))) if len(unique) > _FIND_AT_MOST else None
        longest = len(unique[0]) if unique else 0
        state = cls(unique, tail, 0, len(tail), longest_stop=longest, pattern=pattern)
        state.skip_special = skip_special
        return state

    def find_stop(self, start: int) -> int:
        """Where the earliest stop string in `text[start:]` begins, or -1."""
        if self.pattern is not None:
            match = self.pattern.search(self.text, start)
            return -1 if match is None else match.start()
        hits = [at for s in self.stop if (at := self.text.find(s, start)) != -1]
        return min(hits, default=-1)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def update(self, state: DetokenizerState, output_ids: list[int], stops: bool = True) -> bool:
        """Decode new output tokens into `state.text`; True if a stop string matched (text is cut).
        With `stops` False (a request short of its `min_tokens`) stop strings are not looked for."""
        new = output_ids[state.consumed :]
        if not new:
            return False
        state.consumed = len(output_ids)
        state.ids.extend(new)
        skip = state.skip_special
        prefix = self.tokenizer.decode(state.ids[state.prefix_offset : state.read_offset], skip)
        full = self.tokenizer.decode(state.ids[state.prefix_offset :], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # nothing printable yet, or an incomplete UTF-8 sequence
        search_from = max(0, len(state.text) - state.longest_stop)
        state.text += full[len(prefix) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(state.ids)
        at = state.find_stop(search_from) if stops and state.stop else -1
        if at != -1:
            state.text = state.text[:at]
            return True
        return False

    @staticmethod
    def delta(state: DetokenizerState, finished: bool) -> str:
        """Text not yet returned; while running, holds back what could still start a stop string."""
        hold = 0 if finished else max(state.longest_stop - 1, 0)
        end = max(state.emitted, len(state.text) - hold)
        out = state.text[state.emitted : end]
        state.emitted = end
        return out
