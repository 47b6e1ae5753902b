"""The streaming answer: which SSE chunks one output event becomes."""

from __future__ import annotations

import json

import pytest

from gateway.choice_render import ChoiceRenderer, RenderSpec
from gateway.pipeline.stream import Answer, event_chunks
from loragate.messages import OutputEvent

LAST = {"finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}


def decoded(chunks: list[str]) -> list[dict[str, object]]:
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [json.loads(c.removeprefix("data: ")) for c in chunks]


@pytest.mark.parametrize(
    ("chat", "usage", "event", "expected"),
    [
        (True, False, OutputEvent(text="hi"), ["chat.completion.chunk"]),
        (False, False, OutputEvent(text="hi"), ["text_completion"]),
        (True, False, OutputEvent(), []),
        (True, False, OutputEvent(**LAST), ["chat.completion.chunk"]),
        (True, True, OutputEvent(**LAST), ["chat.completion.chunk", "chat.completion.chunk"]),
        (False, True, OutputEvent(text="x", **LAST), ["text_completion", "text_completion"]),
        (True, True, OutputEvent(error={"status": 400, "message": "bad"}), ["error"]),
    ],
    ids=[
        "chat text",
        "completion text",
        "empty, not last: nothing",
        "last, no text",
        "last with usage",
        "completion last with usage",
        "error",
    ],
)
def test_event_chunks(chat: bool, usage: bool, event: OutputEvent, expected: list[str]) -> None:
    chunks = decoded(
        event_chunks(Answer("r-1", "tiny", chat, usage), 7, event, ChoiceRenderer(RenderSpec(chat)))
    )
    assert [c.get("object", "error") for c in chunks] == expected


def test_an_error_chunk_leaves_out_the_status() -> None:
    (chunk,) = decoded(
        event_chunks(
            Answer("r", "m", True),
            0,
            OutputEvent(error={"status": 503, "code": "x"}),
            ChoiceRenderer(RenderSpec(True)),
        )
    )
    assert chunk == {"error": {"code": "x"}}


def test_the_usage_chunk_counts_the_tokens() -> None:
    text, usage = decoded(
        event_chunks(Answer("r", "m", False, True), 0, OutputEvent(**LAST), ChoiceRenderer(RenderSpec(False)))
    )
    assert text["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert usage["usage"]["completion_tokens"] == 2  # type: ignore[index]
