"""End to end, several choices in one request and vLLM's tokenizer endpoints, through a real stack of one
worker (so every choice meets its prompt in the same prefix cache): `n` choices, collected and streamed
(the official `openai` client too), a list of prompts each answered as alone, seeds per choice, and
`/tokenize` + `/detokenize`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.stack import ADMIN_TOKEN, Stack, running_stack
from worker.modelzoo.make import ZooPaths

KEY = "sk-test-alice"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough for several full KV blocks: the siblings of choice 0 find them in the prefix cache.
PROMPT = "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number iteratively, step by step\n    " * 4
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        zoo, redis_server, Path(tmp_path_factory.mktemp("choices")), workers=("c1",), admission_wait_bound_s=0
    ) as s:
        yield s


def complete(stack: Stack, **body: Any) -> dict[str, Any]:
    got = httpx.post(f"{stack.url}/v1/completions", json={"model": "tiny", **body}, headers=AUTH, timeout=120)
    assert got.status_code == 200, got.text
    return dict(got.json())


def cached_tokens(stack: Stack) -> float:
    """The gateway's count of prompt tokens its requests found cached (every choice's)."""
    for line in httpx.get(f"{stack.url}/metrics", timeout=10).text.splitlines():
        if line.startswith('loragate_prompt_tokens_total{kind="cached"}'):
            return float(line.split()[-1])
    return 0.0


def streamed(stack: Stack, path: str, body: dict[str, Any]) -> list[str]:
    """The `data:` payloads of a streamed answer, in order."""
    with httpx.stream("POST", f"{stack.url}{path}", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e]


def test_n_choices_share_the_prompt_through_the_prefix_cache(stack: Stack) -> None:
    fresh = f"# {uuid.uuid4().hex}\n{PROMPT}"  # no block of it is cached yet
    before = cached_tokens(stack)
    out = complete(stack, prompt=fresh, n=3, **GREEDY)
    hits = cached_tokens(stack) - before
    alone = complete(stack, prompt=fresh, **GREEDY)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert {c["text"] for c in out["choices"]} == {alone["choices"][0]["text"]}  # greedy: all the same
    usage = out["usage"]
    assert usage["prompt_tokens"] == alone["usage"]["prompt_tokens"]  # the prompt once
    assert usage["completion_tokens"] == 3 * 8
    # Choice 0 prefilled the prompt before its siblings were queued: both found it cached.
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and hits == 2 * cached


def test_n_choices_stream_interleaved_with_one_usage_and_one_done(stack: Stack) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = streamed(stack, "/v1/completions", {**body, **GREEDY})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage = [json.loads(e) for e in events[:-1]]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    texts: dict[int, str] = {}
    finished = []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished.append(choice["index"])
    assert sorted(finished) == [0, 1, 2]
    whole = complete(stack, prompt=PROMPT, n=3, **GREEDY)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_a_list_of_prompts_answers_each_as_alone(stack: Stack) -> None:
    tokens = httpx.post(
        f"{stack.url}/tokenize", json={"model": "tiny", "prompt": "import os\nimport"}, headers=AUTH
    ).json()["tokens"]
    prompts: list[Any] = ["The capital of France is", tokens, PROMPT, [int(t) for t in tokens[:3]]]
    out = complete(stack, prompt=prompts, **GREEDY)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    alone = [complete(stack, prompt=p, **GREEDY) for p in prompts]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert out["usage"]["completion_tokens"] == 4 * 8


def test_seeded_choices_differ_and_choice_zero_draws_as_n_1(stack: Stack) -> None:
    sampled = {
        "prompt": "Once upon a time",
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 1234,
        "ignore_eos": True,
    }
    two = complete(stack, n=2, **sampled)["choices"]
    one = complete(stack, **sampled)["choices"]
    assert two[0]["text"] == one[0]["text"] and two[1]["text"] != two[0]["text"]
    assert complete(stack, n=2, **sampled)["choices"] == two  # deterministic


def test_official_client_streams_two_chat_choices(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count to five."}]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        n=2,
        stream=True,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    roles: list[int] = []
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1] and set(finish) == {0, 1}
    whole = client.chat.completions.create(
        model="tiny",
        messages=messages,
        n=2,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_out_of_bounds_choices_are_refused(stack: Stack) -> None:
    for body, param in (({"n": 129}, "n"), ({"n": 0}, "n"), ({"prompt": ["a"] * 130, "n": 2}, "n")):
        got = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": "tiny", "prompt": "x", **body},
            headers=AUTH,
            timeout=30,
        )
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text


def test_tokenize_and_detokenize_round_trip(stack: Stack, zoo: ZooPaths) -> None:
    text = "Hello, tokenizer!"
    got = httpx.post(
        f"{stack.url}/tokenize", json={"model": "tiny:qv-r8", "prompt": text}, headers=AUTH
    ).json()
    assert got["count"] == len(got["tokens"]) > 0 and got["max_model_len"] > 0
    back = httpx.post(
        f"{stack.url}/detokenize", json={"model": "tiny", "tokens": got["tokens"]}, headers=AUTH
    )
    assert back.json() == {"prompt": text}
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(
        f"{stack.url}/tokenize", json={"model": "tiny", "messages": messages}, headers=AUTH
    ).json()
    answer = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 1},
        headers=AUTH,
        timeout=60,
    ).json()
    assert chat["count"] == answer["usage"]["prompt_tokens"]  # what generation sees
    rendered = httpx.post(
        f"{stack.url}/detokenize", json={"model": "tiny", "tokens": chat["tokens"]}, headers=AUTH
    )
    assert "Hi there" in rendered.json()["prompt"]
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    private = {"path": str(zoo.adapter("tiny", "kv-r32")), "tenants": ["bob"]}
    put = httpx.put(f"{stack.url}/admin/adapters/tiny/bobs-kv", json=private, headers=admin)
    assert put.status_code == 201
    hidden = httpx.post(f"{stack.url}/tokenize", json={"model": "tiny:bobs-kv", "prompt": text}, headers=AUTH)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    bob = {"Authorization": "Bearer sk-test-bob"}
    mine = httpx.post(f"{stack.url}/tokenize", json={"model": "tiny:bobs-kv", "prompt": text}, headers=bob)
    assert mine.json()["tokens"] == got["tokens"]


def test_a_list_of_prompts_with_echo_and_logprobs_scores_each_as_alone(stack: Stack) -> None:
    """What lm-eval's loglikelihood sends with `--batch_size 4`: each prompt echoed with its logprobs."""
    prompts = ["The capital of France is Paris", "def add(a, b): return a + b"]
    scoring = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    out = complete(stack, prompt=prompts, **scoring)
    for choice, prompt in zip(out["choices"], prompts, strict=True):
        alone = complete(stack, prompt=prompt, **scoring)["choices"][0]
        assert choice["text"].startswith(prompt) and choice["text"] == alone["text"]
        assert choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            alone["logprobs"]["token_logprobs"], abs=1e-4
        )
