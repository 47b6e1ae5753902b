"""Tool calling, output side, for the formats whose calls are bare JSON (`gateway.tool_formats`):
`llama3_json` (the answer starts with the call) and `mistral` (calls as a JSON list after `[TOOL_CALLS]`).

Both parsers have the `hermes` parser's contract (`gateway.tool_calls.ToolCallParser`): `feed` yields text
and complete calls in order, holding back only what may still become a call; `close` reads what is left.
Whether a would-be call's JSON value has closed is tracked character by character as text arrives
(`ValueEnd`: brackets outside strings), so it is decoded once, when whole — never re-scanned on every
token, which a long answer could make quadratic — and a would-be call that grows past `MAX_CALL_CHARS`
without closing is text. Anything that is not a call to
one of the request's tools stays text, verbatim, marker included. Whitespace around calls is not content.
`make_parser` picks the parser of a format; `parse_output` reads a whole answer.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from gateway.tool_calls import MarkedParser, ParsedCall, Piece, ToolCallParser, read_call
from gateway.tool_formats import LLAMA3_JSON, MISTRAL, ToolFormat

PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARK = "[TOOL_CALLS]"
MAX_CALL_CHARS = 1 << 16
_DECODER = json.JSONDecoder()


class CallParser(Protocol):
    def feed(self, text: str) -> list[Piece]: ...

    def close(self) -> list[Piece]: ...


def _decode(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at `text[at]` and where it ends; None if it is not (yet) complete."""
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError:
        return None


class ValueEnd:
    """Whether the JSON value starting at `start` in a growing text has closed: its brackets outside
    strings balance. Each character is looked at once, however often `ended` is asked."""

    def __init__(self) -> None:
        self._reset(-1)

    def _reset(self, start: int) -> None:
        self.start = self.scanned = start
        self.depth, self.in_string, self.escaped, self.closed = 0, False, False, False

    def ended(self, text: str, start: int) -> bool:
        if start != self.start:  # a new value: forget the last one
            self._reset(start)
        for ch in text[self.scanned :] if not self.closed else "":
            self.scanned += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.closed = True
                    break
        return self.closed


def _skip(text: str, at: int, chars: str = " \t\r\n") -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


class LeadingJsonParser:
    """`llama3_json`: an answer that starts (after whitespace and `<|python_tag|>`) with `{` may be calls,
    `{"name", "parameters" | "arguments"}` separated by `;`: it is held until its first object is whole.
    That object is a call, or the whole answer is text. Whatever follows the calls is text."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.buf = ""  # everything fed since the start (start, calls) or not yet returned (text)
        self.mode = "start"  # start | calls | text
        self.pos = 0  # calls: where the next call would start in `buf`
        self.found = 0  # calls read
        self.value = ValueEnd()

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        if self.mode == "start":
            self._start()
        out: list[Piece] = []
        if self.mode == "calls":
            out = self._calls(final=False)
        if self.mode == "text" and self.buf:
            out.append(self.buf)
            self.buf = ""
        return out

    def close(self) -> list[Piece]:
        out: list[Piece] = self._calls(final=True) if self.mode == "calls" else []
        rest, self.buf = self.buf, ""
        return out + ([rest] if rest else [])

    def _start(self) -> None:
        head = self.buf.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(head):
            return  # empty, or maybe the tag
        if head.startswith("{"):
            self.mode, self.pos = "calls", len(self.buf) - len(head)
        elif head:
            self.mode = "text"

    def _calls(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self.found:  # after a call: whitespace, maybe `;`, then the next call or the end
                self.pos = _skip(self.buf, self.pos)
                if self.buf.startswith(";", self.pos):
                    self.pos = _skip(self.buf, self.pos + 1)
                if self.pos == len(self.buf) and not final:
                    return out
                if not self.buf.startswith("{", self.pos):
                    break
            if not final and not self.value.ended(self.buf, self.pos):
                if len(self.buf) - self.pos > MAX_CALL_CHARS:
                    break
                return out
            decoded = _decode(self.buf, self.pos)
            if decoded is None:
                break
            call = read_call(decoded[0], self.names, ("parameters", "arguments"))
            if call is None:
                break
            out.append(call)
            self.found += 1
            self.pos = decoded[1]
        # Not (or no more) calls: the whole answer is text if nothing was a call, else what follows them.
        self.buf = self.buf if not self.found else self.buf[self.pos :]
        self.mode = "text"
        return out


class MarkedListParser(MarkedParser):
    """`mistral`: text until `[TOOL_CALLS]`, then a JSON list of calls `{"name", "arguments"}` (or one
    call object). The list is read when whole: every item a call, or all of it text, marker included."""

    marker = MISTRAL_MARK

    def __init__(self, names: frozenset[str]):
        super().__init__(names)
        self.value = ValueEnd()

    def _inside(self, out: list[Piece], final: bool) -> bool:
        """Read the list after a marker into `out`; False while it may still be incomplete."""
        at = _skip(self.buf, 0)
        whole = at < len(self.buf) and self.value.ended(self.buf, at)
        if not final and not whole and len(self.buf) <= MAX_CALL_CHARS:
            return False
        decoded = _decode(self.buf, at) if at < len(self.buf) else None
        self.inside = False
        self.value = ValueEnd()
        if decoded is not None:
            items = decoded[0] if isinstance(decoded[0], list) else [decoded[0]]
            calls = [read_call(item, self.names) for item in items]
            if items and all(c is not None for c in calls):
                out.extend(c for c in calls if c is not None)
                self.buf, self.after_call = self.buf[decoded[1] :], True
                return True
            text = self.space + MISTRAL_MARK + self.buf[: decoded[1]]
            self.buf = self.buf[decoded[1] :]
        else:
            text, self.buf = self.space + MISTRAL_MARK + self.buf, ""
        out.append(text)
        return True


def make_parser(fmt: ToolFormat, names: frozenset[str]) -> CallParser:
    if fmt.name == LLAMA3_JSON.name:
        return LeadingJsonParser(names)
    if fmt.name == MISTRAL.name:
        return MarkedListParser(names)
    return ToolCallParser(names)


def parse_output(text: str, names: frozenset[str], fmt: ToolFormat) -> tuple[str, list[ParsedCall]]:
    """A whole output: its content (the text pieces joined) and its calls."""
    parser = make_parser(fmt, names)
    pieces = parser.feed(text) + parser.close()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, [p for p in pieces if isinstance(p, ParsedCall)]
