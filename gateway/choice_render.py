"""One choice of an answer, rendered from its output events: the streamed deltas and the final choice.

A request's choice reads its worker's output events in order. `ChoiceRenderer.feed` turns each into the
choice objects of SSE chunks (`{"index", "delta" | "text", "logprobs", "finish_reason"}`); `final` gives
the whole choice of a non-streamed answer (`{"index", "message" | "text", "logprobs", "finish_reason"}`).
Both come from the same state, built as events are fed, so a streamed answer and a whole one say the same.
The surrounding chunk or body (id, object, created, model, usage) is the caller's (`gateway.protocol`).

What `RenderSpec` asks for (`gateway.pipeline.prompt.render_spec` decides it per request):
- `logprobs`: each token's log-probability in OpenAI's shape (`gateway.logprobs_shape`), with a chunk's
  tokens on that chunk (tokens whose text is held back ride on the next chunk out).
- `echo` (completions): the prompt's text first, in the first chunk, and with `logprobs` its tokens'
  log-probabilities first (the first token's is None).
- `tools` (chat): the output is read for tool calls in `tool_format`'s syntax (`gateway.tool_formats`,
  `gateway.tool_calls_json.make_parser`); calls get ids of that format. A call goes out as two
  deltas, OpenAI's chunk shape: `{"tool_calls": [{"index", "id", "type": "function", "function":
  {"name", "arguments": ""}}]}`, then its `arguments`; the message has `tool_calls`, its `content` is
  None when only calls came, and a choice that ends by itself with calls finishes `"tool_calls"`. With
  `parallel_tools` False only the first call is kept (later ones are dropped, neither calls nor content).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.logprobs_shape import Entry, TokenText, chat_logprobs, completion_logprobs
from gateway.tool_calls import ParsedCall
from gateway.tool_calls_json import make_parser
from gateway.tool_formats import HERMES, ToolFormat
from loragate.messages import OutputEvent


@dataclass(frozen=True)
class RenderSpec:
    """How a request's choices are shown (the same for each of its choices)."""

    chat: bool
    logprobs: TokenText | None = None  # show token log-probabilities; a token id's text and bytes
    echo: str | None = None  # completions: the prompt's text, shown first
    echo_first: int | None = None  # with echo and logprobs: the prompt's first token id
    tools: frozenset[str] | None = None  # chat: read the output for calls to these functions
    parallel_tools: bool = True  # False (`parallel_tool_calls: false`): only the first call is kept
    tool_format: ToolFormat = HERMES  # the syntax calls are read in


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ChoiceRenderer:
    def __init__(self, spec: RenderSpec, index: int = 0):
        self.spec, self.index = spec, index
        self.texts: list[str] = []  # the choice's text (content: without the calls)
        self.calls: list[ToolCall] = []
        self.entries: list[Entry] = []  # every token's log-probability, in order
        self.finish_reason: str | None = None
        self._parser = make_parser(spec.tool_format, spec.tools) if spec.tools is not None else None
        self._unsent: list[Entry] = []  # log-probabilities not yet on a chunk
        self._offset = 0  # completions' text_offset of the next streamed token
        self._started = False

    def feed(self, event: OutputEvent) -> list[dict[str, Any]]:
        """The choice objects one event adds to a stream (none for an event that adds nothing visible
        and does not end it)."""
        text, entries = event.text, [Entry.of(lp) for lp in event.logprobs]
        if not self._started:
            self._started = True
            text, entries = (self.spec.echo or "") + text, self._echo_entries(event) + entries
        if self.spec.logprobs is not None:
            self.entries += entries
            self._unsent += entries
        pieces = self._pieces(text, event.is_last)
        if event.is_last:
            self.finish_reason = event.finish_reason
            if self.calls and event.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        out = [c for p in pieces for c in self._chunk_choices(p)]
        if event.is_last and not out:
            out += self._chunk_choices("")
        if out:
            out[0]["logprobs"] = self._take_logprobs()
            out[-1]["finish_reason"] = self.finish_reason if event.is_last else None
        return out

    def final(self) -> dict[str, Any]:
        """The whole choice, once every event was fed."""
        text = "".join(self.texts)
        choice: dict[str, Any] = {"index": self.index}
        if self.spec.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.calls:
                message["content"] = text or None
                message["tool_calls"] = [c.as_dict() for c in self.calls]
            choice["message"] = message
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(self.entries, 0)[0] if self.spec.logprobs is not None else None
        choice["finish_reason"] = self.finish_reason
        return choice

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first choice object: the assistant role."""
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    # -- internals ----------------------------------------------------------------------------------
    def _echo_entries(self, event: OutputEvent) -> list[Entry]:
        if self.spec.echo is None or self.spec.echo_first is None:
            return []
        return [Entry(self.spec.echo_first, None, None)] + [Entry.of(lp) for lp in event.prompt_logprobs]

    def _pieces(self, text: str, last: bool) -> list[str | ToolCall]:
        if self._parser is None:
            return [text] if text else []
        pieces = self._parser.feed(text) + (self._parser.close() if last else [])
        out: list[str | ToolCall] = []
        for p in pieces:
            if isinstance(p, ParsedCall):
                if self.calls and not self.spec.parallel_tools:
                    continue  # one call asked for, the model was free (`auto`) and wrote more: dropped
                out.append(self._record(p))
            else:
                out.append(p)
        return out

    def _record(self, parsed: ParsedCall) -> ToolCall:
        call = ToolCall(self.spec.tool_format.call_id(), parsed.name, parsed.arguments)
        self.calls.append(call)
        return call

    def _chunk_choices(self, piece: str | ToolCall) -> list[dict[str, Any]]:
        if isinstance(piece, ToolCall):  # its name (with id and type), then its arguments
            i = self.calls.index(piece)
            head = {"index": i, "id": piece.id, "type": "function"}
            head["function"] = {"name": piece.name, "arguments": ""}
            tail = {"index": i, "function": {"arguments": piece.arguments}}
            return [self._delta({"tool_calls": [head]}), self._delta({"tool_calls": [tail]})]
        self.texts.append(piece)
        if self.spec.chat:
            return [self._delta({"content": piece} if piece else {})]
        return [{"index": self.index, "text": piece, "logprobs": None, "finish_reason": None}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _take_logprobs(self) -> dict[str, Any] | None:
        if self.spec.logprobs is None or not self._unsent:
            return None
        shape, self._offset = self._logprobs(self._unsent, self._offset)
        self._unsent = []
        return shape

    def _logprobs(self, entries: list[Entry], offset: int) -> tuple[dict[str, Any], int]:
        token = self.spec.logprobs
        if token is None:
            return {}, offset
        if self.spec.chat:
            return chat_logprobs(entries, token), offset
        return completion_logprobs(entries, token, offset)
