"""Stage choices: what a request of several choices asks — the bounds on `n` and on prompts, each
choice's id, fingerprint and seed, each prompt tokenized on its own, and the usage of the whole answer."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.choice_render import RenderSpec
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.choices import (
    ChoicePlan,
    choice_seed,
    choices_per_prompt,
    choices_usage,
    plan_choices,
    prompt_items,
)
from gateway.pipeline.job import choice_job
from gateway.protocol import SEED_MAX, SEED_MIN
from loragate.messages import OutputEvent
from tests.gateway.pipeline.live_context import call, http_request, job, prompt, resolved, run
from worker.modelzoo.make import ZooPaths


@pytest.mark.parametrize(
    ("body", "items", "n"),
    [
        pytest.param({}, ["hi"], 1, id="one prompt, n absent"),
        pytest.param({"n": None}, ["hi"], 1, id="n null is 1"),
        pytest.param({"n": 128}, ["hi"], 128, id="n at its bound"),
        pytest.param({"prompt": ["a", [1, 2]], "n": 3}, ["a", [1, 2]], 3, id="two prompts, three each"),
        pytest.param({"prompt": ["a"] * 256}, ["a"] * 256, 1, id="256 prompts"),
    ],
)
def test_prompt_items_and_choices_per_prompt(body: dict[str, Any], items: list[Any], n: int) -> None:
    c = call(**body)
    assert prompt_items(c) == items and choices_per_prompt(c) == n


def test_chat_has_one_prompt() -> None:
    assert prompt_items(call(chat=True, n=4)) == [None]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"prompt": ["a", "b", "c"], "n": 128}, id="384 choices"),
        pytest.param({"prompt": ["a"] * 129, "n": 2}, id="258 choices"),
    ],
)
def test_more_than_256_choices_are_refused_naming_n(body: dict[str, Any]) -> None:
    with pytest.raises(APIError) as e:
        prompt_items(call(**body))
    assert e.value.status == 400 and e.value.param == "n" and "at most 256" in e.value.message


@pytest.mark.parametrize("seed", [0, 7, SEED_MIN, SEED_MAX, -1])
def test_choice_seeds_are_distinct_deterministic_and_in_range(seed: int) -> None:
    seeds = [choice_seed(seed, j) for j in range(64)]
    assert seeds[0] == seed  # choice 0 draws what n=1 would
    assert len(set(seeds)) == 64 and seeds == [choice_seed(seed, j) for j in range(64)]
    assert all(s is not None and SEED_MIN <= s <= SEED_MAX for s in seeds)


def test_unseeded_choices_stay_unseeded() -> None:
    assert {choice_seed(None, j) for j in range(4)} == {None}


def test_choice_ids_share_the_clients_id_and_differ_inside(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        base = job(ctx, "req-choices-1")
        jobs = [choice_job(base, i, 3, prompt()) for i in range(3)]
        assert {j.request_id for j in jobs} == {"req-choices-1"}
        assert [j.qid for j in jobs] == [base.qid, f"{base.qid}~1", f"{base.qid}~2"]
        # Each choice's fingerprint names its place: a retry asking other choices conflicts (409).
        prints = {j.fingerprint for j in jobs} | {choice_job(base, 0, 2, prompt()).fingerprint}
        assert len(prints) == 4 and base.fingerprint not in prints

    run(redis_url, body)


def test_each_prompt_is_tokenized_and_budgeted_on_its_own(redis_url: str, zoo: ZooPaths) -> None:
    async def body(ctx: GatewayContext) -> None:
        c = call(prompt=["Hello there, friend", [5, 6, 7]], n=2, seed=11, max_tokens=4)
        plans = plan_choices(ctx, http_request(), c, resolved(ctx), prompt_items(c), 2)
        assert [(p.index, p.prompt_index, p.lead) for p in plans] == [
            (0, 0, 0),
            (1, 0, 0),
            (2, 1, 2),
            (3, 1, 2),
        ]
        tok = ctx.tokenizers.get(str(zoo.base("tiny")))
        assert plans[0].prompt.token_ids == tuple(tok.encode("Hello there, friend"))
        assert plans[2].prompt.token_ids == plans[3].prompt.token_ids == (5, 6, 7)
        assert {p.prompt.max_tokens for p in plans} == {4}
        assert [p.prompt.params.seed for p in plans] == [11, choice_seed(11, 1), 11, choice_seed(11, 1)]
        assert [p.job.message.params.seed for p in plans] == [p.prompt.params.seed for p in plans]
        assert len({p.job.qid for p in plans}) == 4

    run(redis_url, body, model_dir=str(zoo.base("tiny")))


def test_one_bad_prompt_refuses_the_request(redis_url: str, zoo: ZooPaths) -> None:
    async def body(ctx: GatewayContext) -> None:
        c = call(prompt=["fine", [1, 10**9]])
        with pytest.raises(APIError) as e:
            plan_choices(ctx, http_request(), c, resolved(ctx), prompt_items(c), 1)
        assert e.value.status == 400 and e.value.param == "prompt"

    run(redis_url, body, model_dir=str(zoo.base("tiny")))


def test_usage_counts_each_prompt_once_and_every_completion(redis_url: str) -> None:
    async def body(ctx: GatewayContext) -> None:
        base = job(ctx)
        plans = [
            ChoicePlan(i, i // 2, i // 2 * 2, choice_job(base, i, 4, prompt()), prompt(), RenderSpec(False))
            for i in range(4)
        ]
        last = {
            0: OutputEvent(prompt_tokens=10, completion_tokens=3, cached_tokens=0, finish_reason="stop"),
            1: OutputEvent(prompt_tokens=10, completion_tokens=4, cached_tokens=8, finish_reason="stop"),
            2: OutputEvent(prompt_tokens=6, completion_tokens=1, cached_tokens=0, finish_reason="length"),
            3: OutputEvent(prompt_tokens=6, completion_tokens=2, cached_tokens=4, finish_reason="stop"),
        }
        use = choices_usage(plans, last)
        assert (use["prompt_tokens"], use["completion_tokens"], use["total_tokens"]) == (16, 10, 26)
        assert use["prompt_tokens_details"] == {"cached_tokens": 12}

    run(redis_url, body)
