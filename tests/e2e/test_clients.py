"""The clients users bring, end to end against a real stack serving the real model (SmolLM2-135M-Instruct).

The official `openai` client (`chat.completions.parse` with a pydantic model; a tool-call round trip,
streamed and not), langchain-openai (`with_structured_output`, `bind_tools`), litellm with tools, and
lm-eval's `local-completions` (log-likelihood multiple choice and batched `generate_until`) through
`loadtest.lm_eval_run`. Structured answers are forced by the worker's grammar, so they parse and validate
whatever the model would have said; the free parts (the answer after a tool result) are the model's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_eval import smol_stack
from worker.modelzoo.make import ZooPaths

KEY = "sk-test-alice"
pytestmark = pytest.mark.slow


class Weather(BaseModel):
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]
    temperature: int


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def smol(
    zoo: ZooPaths, smollm2: Path, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("clients"))
    # A batch of prompts fans out into one job per prompt; these tests are about what clients get, not
    # about refusing load (tests/e2e/test_overload.py), so the queue-wait bound is off.
    stack_type = smol_stack(smollm2)
    with running_stack(zoo, redis_server, workdir, ("w1",), stack_type, admission_wait_bound_s=0) as stack:
        yield stack


@pytest.fixture(scope="module")
def oai(smol: Stack) -> Iterator[openai.OpenAI]:
    """One client for the module, closed at its end (no socket left for the garbage collector to find)."""
    with openai.OpenAI(base_url=f"{smol.url}/v1", api_key=KEY, max_retries=0, timeout=180) as c:
        yield c


@pytest.mark.parametrize("model", ["smollm2", "smollm2:signoff"])
def test_openai_parse_gives_a_validated_pydantic_object(oai: Any, model: str) -> None:
    reply = oai.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Give the weather in Paris as JSON."}],
        response_format=Weather,
        max_tokens=80,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Weather), choice.message.content


def _first_call(reply: Any) -> Any:
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    return call


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_tool_call_round_trip(oai: Any, stream: bool) -> None:
    c = oai
    ask: dict[str, Any] = {
        "model": "smollm2",
        "messages": QUESTION,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 64,
        "temperature": 0,
    }
    if stream:
        with c.chat.completions.stream(**ask) as events:
            kinds = {type(e).__name__ for e in events}
            first = events.get_final_completion()
        assert "FunctionToolCallArgumentsDoneEvent" in kinds, kinds
    else:
        first = c.chat.completions.create(**ask)
    call = _first_call(first)
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 24
    follow_up = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature": 21, "unit": "celsius"}),
        },
    ]
    second = c.chat.completions.create(
        model="smollm2", messages=follow_up, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
    assert answer.message.content or answer.message.tool_calls


def test_openai_required_tool_choice_with_parallel_calls(oai: Any) -> None:
    reply = oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Weather in Paris and the time in CET, please."}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=96,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time"), call
        assert set(args) == ({"city"} if call.function.name == "get_weather" else {"zone"})
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_langchain_structured_output_and_bound_tools(smol: Stack) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    settings: dict[str, Any] = {"base_url": f"{smol.url}/v1", "api_key": KEY, "max_tokens": 80}
    llm = ChatOpenAI(model="smollm2", temperature=0, max_retries=0, **settings)
    weather = llm.with_structured_output(Weather, method="json_schema").invoke("The weather in Oslo as JSON.")
    assert isinstance(weather, Weather)

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"21 degrees in {city}"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Rome?")
    llm.root_client.close()
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_litellm_with_tools(smol: Stack) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm

    # litellm's sync call asks `asyncio.get_event_loop()` for a loop (its service logger), which makes a
    # new one and leaves it unclosed: a later `asyncio.run` drops it and the garbage collector finds its
    # self-pipe sockets open (a ResourceWarning in some later test). Give it a loop of ours, closed here.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        reply = litellm.completion(
            model="openai/smollm2",
            api_base=f"{smol.url}/v1",
            api_key=KEY,
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            max_tokens=64,
            temperature=0,
        )
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls  # parallel calls allowed
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def test_lm_eval_multiple_choice_and_batched_generation(
    smol: Stack, smollm2: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadtest import lm_eval_run

    # In this process (no second interpreter importing torch, transformers and lm-eval anew): the
    # environment it sets (offline hubs, lm-eval's bearer token) is put back after the test.
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("OPENAI_API_KEY", KEY)):
        monkeypatch.setenv(name, value)
    lm_eval_run.main(
        [
            *("--base-url", f"{smol.url}/v1", "--api-key", KEY, "--model", "smollm2"),
            *("--tokenizer", str(smollm2), "--batch-size", "4", "--limit", "4"),
        ]
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["mc_n"] == 4 and report["gen_n"] == 4 and report["batch_size"] == 4
    # The first four documents are capital cities, which SmolLM2 knows: well above chance (25%, 0%).
    assert report["mc_acc"] >= 0.5 and report["gen_exact_match"] >= 0.5, report


def test_streamed_json_schema_and_vllm_guides_through_extra_body(oai: Any) -> None:
    c = oai
    schema = {"name": "weather", "schema": Weather.model_json_schema(), "strict": True}
    stream = c.chat.completions.create(
        model="smollm2:signoff",  # an adapter: the guide applies to whatever model the request runs on
        messages=[{"role": "user", "content": "The weather in Lima as JSON."}],
        response_format={"type": "json_schema", "json_schema": schema},
        stream=True,
        max_tokens=80,
        temperature=0,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Weather.model_validate_json(text)
    year = c.completions.create(
        model="smollm2",
        prompt="The first moon landing was in the year",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": r" (19|20)[0-9]{2}"},
    )
    assert re.fullmatch(r" (19|20)[0-9]{2}", year.choices[0].text), year
    mood = c.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "I love this phone! Is the review positive or negative?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["positive", "negative"]},
    )
    assert mood.choices[0].message.content in ("positive", "negative"), mood


def test_chat_logprobs_through_the_openai_client(oai: Any) -> None:
    reply = oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert reply.usage is not None and len(choice.logprobs.content) == reply.usage.completion_tokens
    for item in choice.logprobs.content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and item.logprob <= 0
        assert item.token == item.top_logprobs[0].token  # greedy: the chosen token is the most likely
    assert "".join(i.token for i in choice.logprobs.content) == choice.message.content
