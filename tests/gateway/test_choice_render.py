"""A choice rendered from output events, as OpenAI shows it: token log-probabilities in the chat and the
completions shapes (streamed chunk by chunk, adding up to the whole answer's), the echoed prompt first,
and tool calls as `message.tool_calls` and as stream deltas the official client's stream helper reads back
into the same calls."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from gateway.choice_render import ChoiceRenderer, RenderSpec
from gateway.protocol import chunk
from gateway.tokenize import ModelTokenizer, load_tokenizer
from loragate.messages import OutputEvent
from loragate.types import TokenLogprob
from worker.modelzoo.make import ZooPaths


@pytest.fixture(scope="module")
def tok(zoo: ZooPaths) -> ModelTokenizer:
    return load_tokenizer(zoo.base("tiny"))


def events_of(
    tok: ModelTokenizer, text: str, finish: str = "stop", sizes: tuple[int, ...] = (1,)
) -> list[OutputEvent]:
    """`text` as a worker streams it: a few tokens per event, each with its log-probability and top 2."""
    ids = tok.encode(text)
    events, at, i = [], 0, 0
    while at < len(ids):
        part = ids[at : at + sizes[i % len(sizes)]]
        at, i = at + len(part), i + 1
        lps = tuple(TokenLogprob(t, -0.5 * (t % 7), ((t, -0.5 * (t % 7)), (t + 1, -3.0))) for t in part)
        last = at >= len(ids)
        events.append(
            OutputEvent(
                text=tok.decode(part),
                token_ids=tuple(part),
                logprobs=lps,
                finish_reason=finish if last else None,
            )
        )
    return events


def run(spec: RenderSpec, events: list[OutputEvent]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The streamed choice objects and the whole choice (each from its own renderer, as the two paths do)."""
    stream = ChoiceRenderer(spec)
    chunks = [c for e in events for c in stream.feed(e)]
    whole = ChoiceRenderer(spec)
    for e in events:
        whole.feed(e)
    return chunks, whole.final()


# --- logprobs ---------------------------------------------------------------------------------------------


def test_chat_logprobs_shape(tok: ModelTokenizer) -> None:
    events = events_of(tok, "Hi there", sizes=(2,))
    chunks, final = run(RenderSpec(chat=True, logprobs=tok.token_text), events)
    ids = [t for e in events for t in e.token_ids]
    assert final["logprobs"]["content"] == [
        {
            "token": tok.token_text(t)[0],
            "logprob": -0.5 * (t % 7),
            "bytes": tok.token_text(t)[1],
            "top_logprobs": [
                {"token": tok.token_text(t)[0], "logprob": -0.5 * (t % 7), "bytes": tok.token_text(t)[1]},
                {"token": tok.token_text(t + 1)[0], "logprob": -3.0, "bytes": tok.token_text(t + 1)[1]},
            ],
        }
        for t in ids
    ]
    assert (
        "".join(e["token"] for e in final["logprobs"]["content"]) == final["message"]["content"] == "Hi there"
    )
    streamed = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert streamed == final["logprobs"]["content"]


def test_completion_logprobs_shape_and_offsets(tok: ModelTokenizer) -> None:
    events = events_of(tok, "one two three", sizes=(1, 3))
    chunks, final = run(RenderSpec(chat=False, logprobs=tok.token_text), events)
    lp = final["logprobs"]
    assert "".join(lp["tokens"]) == final["text"] == "one two three"
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["token_logprobs"] == [-0.5 * (t % 7) for e in events for t in e.token_ids]
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp["top_logprobs"])
    merged: dict[str, list[Any]] = {k: [] for k in lp}
    for c in chunks:
        for k in merged:
            merged[k] += c["logprobs"][k]
    assert merged == lp  # offsets go on counting across chunks


def test_without_logprobs_there_are_none(tok: ModelTokenizer) -> None:
    chunks, final = run(RenderSpec(chat=True), events_of(tok, "Hi"))
    assert final["logprobs"] is None and all(c["logprobs"] is None for c in chunks)


def test_a_partial_character_shows_its_bytes(tok: ModelTokenizer) -> None:
    ids = tok.encode("é")
    assert len(ids) == 2  # the zoo's byte-level tokenizer splits it
    assert [tok.token_text(i) for i in ids] == [("\ufffd", [0xC3]), ("\ufffd", [0xA9])]


def test_logprobs_of_an_event_without_text_ride_on_the_next_chunk(tok: ModelTokenizer) -> None:
    spec = RenderSpec(chat=True, logprobs=tok.token_text)
    a, b = tok.encode("é")
    renderer = ChoiceRenderer(spec)
    assert renderer.feed(OutputEvent(text="", token_ids=(a,), logprobs=(TokenLogprob(a, -1.0),))) == []
    out = renderer.feed(
        OutputEvent(text="é", token_ids=(b,), logprobs=(TokenLogprob(b, -2.0),), finish_reason="stop")
    )
    assert [e["logprob"] for e in out[0]["logprobs"]["content"]] == [-1.0, -2.0]


# --- echo -------------------------------------------------------------------------------------------------


def test_echo_shows_the_prompt_and_its_logprobs_first(tok: ModelTokenizer) -> None:
    prompt = tok.encode("The cat")
    prompt_lps = tuple(TokenLogprob(t, -1.5, ((t, -1.5),)) for t in prompt[1:])
    events = events_of(tok, " sat", sizes=(5,))
    events[0] = replace(events[0], prompt_logprobs=prompt_lps)
    spec = RenderSpec(chat=False, logprobs=tok.token_text, echo="The cat", echo_first=prompt[0])
    chunks, final = run(spec, events)
    assert final["text"] == "The cat sat" and chunks[0]["text"] == "The cat sat"
    lp = final["logprobs"]
    n = len(prompt)
    assert "".join(lp["tokens"]) == "The cat sat"
    assert lp["token_logprobs"][:n] == [None] + [-1.5] * (n - 1)
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {tok.token_text(prompt[1])[0]: -1.5}
    assert lp["text_offset"][:2] == [0, len(tok.token_text(prompt[0])[0])]


def test_echo_without_logprobs_is_just_text(tok: ModelTokenizer) -> None:
    chunks, final = run(RenderSpec(chat=False, echo="Q: "), events_of(tok, "A"))
    assert final["text"] == "Q: A" and final["logprobs"] is None
    assert chunks[0]["text"] == "Q: A"


# --- tool calls -------------------------------------------------------------------------------------------

NAMES = frozenset({"get_weather", "get_time"})
TWO_CALLS = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def text_events(text: str, sizes: list[int], finish: str = "stop") -> list[OutputEvent]:
    out, at = [], 0
    for size in sizes:
        if at >= len(text):
            break
        out.append(OutputEvent(text=text[at : at + size]))
        at += size
    out.append(OutputEvent(text=text[at:], finish_reason=finish))
    return out


def accumulate(chunks: list[dict[str, Any]]) -> tuple[Any, list[str]]:
    """What the official client's stream helper makes of the chunks: the choice, the events' kinds."""
    state, kinds = ChatCompletionStreamState(), []
    role = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    for c in [role, *chunks]:
        events = state.handle_chunk(
            ChatCompletionChunk.model_validate(chunk("chatcmpl-1", "m", 1, True, [c]))
        )
        kinds += [type(e).__name__ for e in events]
    return state.get_final_completion().choices[0], kinds


def test_tool_calls_in_the_whole_message() -> None:
    _, final = run(RenderSpec(chat=True, tools=NAMES), text_events(TWO_CALLS, [len(TWO_CALLS)]))
    assert final["finish_reason"] == "tool_calls"
    message = final["message"]
    assert message["content"] == "Checking."
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]


def test_only_calls_leave_no_content() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    _, final = run(RenderSpec(chat=True, tools=NAMES), text_events(text, [3, 3]))
    assert final["message"]["content"] is None and len(final["message"]["tool_calls"]) == 1


@pytest.mark.parametrize("seed", range(8))
def test_streamed_tool_calls_read_back_as_the_whole_answer(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [1] * len(TWO_CALLS) if seed == 0 else [rng.randint(1, 12) for _ in range(len(TWO_CALLS))]
    chunks, final = run(RenderSpec(chat=True, tools=NAMES), text_events(TWO_CALLS, sizes))
    deltas = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert [set(d) for d in deltas] == [{"index", "id", "type", "function"}, {"index", "function"}] * 2
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    got, kinds = accumulate(chunks)
    assert kinds.count("FunctionToolCallArgumentsDoneEvent") == 2, kinds
    assert got.finish_reason == "tool_calls" == final["finish_reason"]
    assert got.message.content == final["message"]["content"] == "Checking."
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in final["message"]["tool_calls"]
    ]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert all(c["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize("sizes", [[len(TWO_CALLS)], [1] * len(TWO_CALLS), [9] * 20], ids=["whole", "1", "9"])
def test_without_parallel_calls_only_the_first_is_kept(sizes: list[int]) -> None:
    """`parallel_tool_calls: false` under `auto`: the model may still write two; the answer has one."""
    chunks, final = run(
        RenderSpec(chat=True, tools=NAMES, parallel_tools=False), text_events(TWO_CALLS, sizes)
    )
    calls = final["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and final[
        "finish_reason"
    ] == "tool_calls"
    assert final["message"]["content"] == "Checking."
    deltas = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert [d["index"] for d in deltas] == [0, 0] and "get_time" not in json.dumps(chunks)


def test_a_call_cut_by_the_length_limit_finishes_length() -> None:
    _, final = run(RenderSpec(chat=True, tools=NAMES), text_events(TWO_CALLS, [10], finish="length"))
    assert final["finish_reason"] == "length" and len(final["message"]["tool_calls"]) == 2


def test_unknown_tools_stay_content() -> None:
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    chunks, final = run(RenderSpec(chat=True, tools=NAMES), text_events(text, [4, 4, 4]))
    assert final["message"] == {"role": "assistant", "content": text} and final["finish_reason"] == "stop"
    assert "".join(c["delta"].get("content", "") for c in chunks) == text


def test_without_tools_a_call_is_plain_text() -> None:
    _, final = run(RenderSpec(chat=True), text_events(TWO_CALLS, [7]))
    assert final["message"] == {"role": "assistant", "content": TWO_CALLS}
