"""Tool calls in a model family's own syntax, end to end: a real stack whose two workers serve models with a
Mistral-style and a Llama-3-style chat template (`tests.tool_models`), through the official `openai`
client. A forced call is written in the family's syntax by the worker's grammar — Mistral's through its
`[TOOL_CALLS]` control token, which the worker keeps in the text for the gateway to read — and comes back
as OpenAI `tool_calls`, whole and streamed; the call, with its id, and the tool's result then render
through the family's template on the next turn (Mistral's refuses any id but 9 letters and digits)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.tool_formats import MISTRAL
from tests.e2e.stack import Stack, running_stack
from tests.tool_models import family_model
from worker.modelzoo.make import ZooPaths

KEY = "sk-test-alice"
pytestmark = pytest.mark.slow
FAMILIES = {"w-mistral": "mistral", "w-llama3": "llama3"}

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("tool-formats"))
    models = {w: family_model(zoo.base("tiny"), workdir / f, f) for w, f in FAMILIES.items()}

    class FamilyStack(Stack):
        def start_worker(self, worker_id: str, base: str = "", metrics_port: int | None = None) -> None:
            self.workers[worker_id] = self._spawn(
                [
                    "worker",
                    *("--model", str(models[worker_id]), "--model-name", FAMILIES[worker_id]),
                    *("--worker-id", worker_id, "--kv-cache-mb", "64"),
                ],
                f"{worker_id}.log",
            )

    with running_stack(zoo, redis_server, workdir, tuple(FAMILIES), FamilyStack) as s:
        yield s


@pytest.fixture(scope="module")
def oai(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def check_id(family: str, call_id: str) -> None:
    if family == "mistral":
        assert len(call_id) == 9 and call_id.isalnum() and call_id.isascii(), call_id
    else:
        assert call_id.startswith("call_"), call_id


@pytest.mark.parametrize("family", ["mistral", "llama3"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_in_the_familys_syntax_comes_back_as_tool_calls(
    oai: Any, family: str, stream: bool
) -> None:
    ask: dict[str, Any] = {
        "model": family,
        "messages": QUESTION,
        "tools": [WEATHER, TIME],
        "tool_choice": named("get_weather"),
        "max_tokens": 96,
        "temperature": 0,
    }
    if stream:
        with oai.chat.completions.stream(**ask) as events:
            kinds = {type(e).__name__ for e in events}
            reply = events.get_final_completion()
        assert "FunctionToolCallArgumentsDoneEvent" in kinds, kinds
    else:
        reply = oai.chat.completions.create(**ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content, choice.message.content  # the marker and the JSON are not content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 8
    check_id(family, call.id)


@pytest.mark.parametrize("family", ["mistral", "llama3"])
def test_required_calls_follow_the_familys_rules(oai: Any, family: str) -> None:
    reply = oai.chat.completions.create(
        model=family,
        messages=[{"role": "user", "content": "The time in CET?"}],
        tools=[TIME],
        tool_choice="required",
        parallel_tool_calls=family == "llama3",  # Llama 3 shows one call per turn: asked for more, one
        max_tokens=64,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)["zone"] in ("UTC", "CET")) == (
        "get_time",
        True,
    )


@pytest.mark.parametrize("family", ["mistral", "llama3"])
@pytest.mark.parametrize("client_id", [False, True], ids=["our id", "an OpenAI-style id"])
def test_the_call_and_its_result_render_through_the_familys_template(
    stack: Stack, oai: Any, family: str, client_id: bool
) -> None:
    first = oai.chat.completions.create(
        model=family,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice=named("get_weather"),
        max_tokens=96,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0].model_dump()
    if client_id:
        call["id"] = "call_7Hq2m9ZkLw0pXr3s"  # as another provider would have named it
    follow_up = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"celsius": 18})},
    ]
    second = oai.chat.completions.create(
        model=family, messages=follow_up, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt the template made of it (vLLM's /tokenize, read back): the call and its result, tied.
    headers = {"authorization": f"Bearer {KEY}"}
    ask = {"model": family, "messages": follow_up, "tools": [WEATHER]}
    tokens = httpx.post(f"{stack.url}/tokenize", json=ask, headers=headers, timeout=30).json()["tokens"]
    back = {"model": family, "tokens": tokens}
    prompt = httpx.post(f"{stack.url}/detokenize", json=back, headers=headers, timeout=30).json()["prompt"]
    arguments = json.dumps(json.loads(call["function"]["arguments"]))
    if family == "mistral":
        shown_id = call["id"] if not client_id else MISTRAL.template_id(call["id"])
        assert len(shown_id) == 9
        assert (
            f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {arguments}, "id": "{shown_id}"}}]' in prompt
        )
        assert f'[TOOL_RESULTS]{{"content": "{{\\"celsius\\": 18}}", "call_id": "{shown_id}"}}' in prompt
    else:
        assert f'{{"name": "get_weather", "parameters": {arguments}}}<|eot_id|>' in prompt
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"celsius": 18}<|eot_id|>' in prompt
