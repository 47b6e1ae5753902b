"""Tool calling, output side: the model's text read back as content and tool calls, incrementally.

What every format's parser shares (`ParsedCall`, `read_call`), and the `hermes` format's parser
(`gateway.tool_formats`; also the default format, `gateway.tools`): the model writes `<tool_call>\\n{"name":
..., "arguments": {...}}\\n</tool_call>`. `ToolCallParser` reads the output as it streams and yields, in
order, plain text and complete calls. It holds back only what may still turn into a call: a tail that may be
the start of `<tool_call>`, the inside of an open block, and trailing whitespace (whitespace around a call
is not content). A block becomes a call when its JSON is an object with a `name` among the request's tools
and an `arguments` object; anything else — bad JSON, an unknown tool — stays text, verbatim. A block the
output ends inside (EOS or a stop before `</tool_call>`) is read the same way. The same parser serves the
streamed and the whole answer, so both give the same calls and content whatever the chunking.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


Piece = str | ParsedCall


class MarkedParser:
    """Text until a marker, then what the marker opens, read by `_inside`; the text before a marker that
    opens calls loses its trailing whitespace, as does the text after calls its leading whitespace.
    What may still become a marker (a prefix of it at the end, and the whitespace before) is held back."""

    marker = OPEN

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.buf = ""
        self.inside = False  # after a marker (buf: what followed it)
        self.after_call = False  # whitespace right after a call is dropped
        self.space = ""  # the whitespace before the marker: dropped if calls follow

    def feed(self, text: str) -> list[Piece]:
        """What `text` (the next part of the output) completes: text and calls, in order."""
        self.buf += text
        out: list[Piece] = []
        while True:
            if self.inside:
                if not self._inside(out, final=False):
                    return out
                continue
            if self.after_call:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.after_call = False
            start = self.buf.find(self.marker)
            if start >= 0:
                head = self.buf[:start].rstrip()
                if head:
                    out.append(head)
                self.space = self.buf[len(head) : start]
                self.buf = self.buf[start + len(self.marker) :]
                self.inside = True
                continue
            ready = len(self.buf) - held(self.buf, self.marker)
            if ready:
                out.append(self.buf[:ready])
                self.buf = self.buf[ready:]
            return out

    def close(self) -> list[Piece]:
        """The end of the output: what was held back, read for what it is."""
        out: list[Piece] = []
        if self.inside:
            self._inside(out, final=True)
        rest, self.buf = self.buf, ""
        if self.after_call:
            rest = rest.lstrip()
        return out + ([rest] if rest else [])

    def _inside(self, out: list[Piece], final: bool) -> bool:
        """Read what follows the marker into `out` (leaving `inside`); False while it may still grow."""
        raise NotImplementedError


class ToolCallParser(MarkedParser):
    """`hermes`: `<tool_call>` blocks, each read when its `</tool_call>` arrives (or the output ends)."""

    def _inside(self, out: list[Piece], final: bool) -> bool:
        end = self.buf.find(CLOSE)
        if end < 0 and not final:
            return False
        inner, closed = (self.buf[:end], True) if end >= 0 else (self.buf, False)
        self.buf = self.buf[end + len(CLOSE) :] if end >= 0 else ""
        self.inside = False
        out.append(self._block(inner, closed))
        return True

    def _block(self, inner: str, closed: bool) -> Piece:
        call = self._call(inner)
        if call is not None:
            self.after_call = True
            return call
        return self.space + OPEN + inner + (CLOSE if closed else "")

    def _call(self, inner: str) -> ParsedCall | None:
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        return read_call(obj, self.names)


def read_call(
    obj: Any, names: frozenset[str], args_keys: tuple[str, ...] = ("arguments",)
) -> ParsedCall | None:
    """`obj` as a call: an object whose `name` is one of `names` and whose arguments (the first of
    `args_keys` present) are an object; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None  # a name that is not a string (a list, an object) is no call, and not hashable
    if obj["name"] not in names:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj.get(key) if key is not None else None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held(buf: str, marker: str = OPEN) -> int:
    """How many trailing characters may still belong to a call: a prefix of `marker` and the whitespace
    before it."""
    keep = next((k for k in range(min(len(marker) - 1, len(buf)), 0, -1) if buf.endswith(marker[:k])), 0)
    return len(buf) - len(buf[: len(buf) - keep].rstrip())
