"""One choice of an answer, rendered from its output events: the streamed deltas and the final choice.

A request's choice reads its worker's output events in order. `ChoiceRenderer.feed` turns each into the
choice objects of an SSE chunk (`{"index", "delta" | "text", "logprobs", "finish_reason"}`), `final` gives
the whole choice of a non-streamed answer (`{"index", "message" | "text", "logprobs", "finish_reason"}`).
The surrounding chunk or body (id, object, created, model, usage) is the caller's (`gateway.protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loragate.messages import OutputEvent


@dataclass(frozen=True)
class RenderSpec:
    """How a request's choices are shown (the same for each of its choices)."""

    chat: bool


class ChoiceRenderer:
    def __init__(self, spec: RenderSpec, index: int = 0):
        self.spec, self.index = spec, index
        self.texts: list[str] = []
        self.finish_reason: str | None = None

    def feed(self, event: OutputEvent) -> list[dict[str, Any]]:
        """The choice objects one event adds to a stream (none for an empty event that does not end it)."""
        self.texts.append(event.text)
        if event.is_last:
            self.finish_reason = event.finish_reason
        if not event.text and not event.is_last:
            return []
        return [self._chunk_choice(event.text, event.finish_reason if event.is_last else None)]

    def final(self) -> dict[str, Any]:
        """The whole choice, once every event was fed."""
        text = "".join(self.texts)
        choice: dict[str, Any] = {"index": self.index}
        if self.spec.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = self.finish_reason
        return choice

    def _chunk_choice(self, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index}
        if self.spec.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        return choice

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first choice object: the assistant role."""
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
