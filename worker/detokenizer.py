"""Incremental detokenization with stop strings, for streaming text deltas.

Text of new tokens is `decode(ids[prefix:]) - decode(ids[prefix:read])`: decoding with a little context
keeps word-boundary spaces right for SentencePiece-style tokenizers, and the delta is released only when
it does not end in a replacement character (byte-level BPE tokens may end inside a UTF-8 character).
With stop strings, the last `len(longest stop) - 1` characters are held back until the request ends, so
no delta ever carries the start of a stop string that a later token completes. On a match the text is
cut before the stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)  # a few prompt tokens of context, then the output
    prefix_offset: int = 0
    read_offset: int = 0
    consumed: int = 0  # output tokens appended to `ids`
    text: str = ""  # decoded output text so far
    emitted: int = 0  # characters of `text` already returned as deltas

    @classmethod
    def start(cls, prompt_ids: list[int] | tuple[int, ...], stop: tuple[str, ...]) -> DetokenizerState:
        tail = list(prompt_ids[-_CONTEXT_TOKENS:])
        return cls(stop=stop, ids=tail, prefix_offset=0, read_offset=len(tail))


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
        prefix = self.tokenizer.decode(state.ids[state.prefix_offset : state.read_offset])
        full = self.tokenizer.decode(state.ids[state.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # nothing printable yet, or an incomplete UTF-8 sequence
        search_from = max(0, len(state.text) - max((len(s) for s in state.stop), default=0))
        state.text += full[len(prefix) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(state.ids)
        hits = [at for s in state.stop if stops and (at := state.text.find(s, search_from)) != -1]
        if hits:
            state.text = state.text[: min(hits)]
            return True
        return False

    @staticmethod
    def delta(state: DetokenizerState, finished: bool) -> str:
        """Text not yet returned; while running, holds back what could still start a stop string."""
        hold = 0 if finished else max((len(s) for s in state.stop), default=1) - 1
        end = max(state.emitted, len(state.text) - hold)
        out = state.text[state.emitted : end]
        state.emitted = end
        return out
