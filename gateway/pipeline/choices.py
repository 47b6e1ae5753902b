"""Stage choices: what a request of several choices asks — `n` choices per prompt, and (completions) a
list of prompts — as one job per choice, each through the usual stages (`gateway.pipeline.fanout` runs
them). Choice `p * n + j` is choice j of prompt p. Every prompt is tokenized and budgeted on its own (its
own `max_tokens` within the context, its own render spec); every choice is its own scoped request
(`job.choice_job`), answering under the client's id.

Seeds: choice 0 keeps the request's seed (so `n=1` and choice 0 of `n=3` draw the same), choice j > 0 a
seed derived from (seed, j), distinct and within the 64-bit range (the worker hashes seeds anyway).
Unseeded choices differ by themselves; greedy choices are all the same (as vLLM's)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request

from gateway import protocol
from gateway.choice_render import RenderSpec
from gateway.context import GatewayContext
from gateway.errors import bad_request
from gateway.pipeline.job import Job, choice_job, make_job
from gateway.pipeline.parse import Call
from gateway.pipeline.prompt import Prompt, render_spec, tokenize
from gateway.pipeline.resolve import Resolved
from loragate.messages import OutputEvent

MAX_CHOICES = 256  # choices (jobs) in one request: n times the number of prompts


@dataclass(frozen=True)
class ChoicePlan:
    index: int  # in the answer's `choices`
    prompt_index: int
    lead: int  # the index of its prompt's first choice: it starts at once, the others once it has output
    job: Job
    prompt: Prompt  # its tokens, budget and sampling (its own seed)
    spec: RenderSpec  # how it shows (its prompt's)


def choices_per_prompt(call: Call) -> int:
    """`n` (checked by `protocol.parse_common`; null is 1)."""
    return int(call.body.get("n") or 1)


def prompt_items(call: Call) -> list[Any]:
    """The request's prompts as given (chat: its one conversation, None), within `MAX_CHOICES` jobs."""
    items: list[Any] = [None] if call.chat else protocol.completion_prompts(call.body)
    total = len(items) * choices_per_prompt(call)
    if total > MAX_CHOICES:
        raise bad_request(
            f"A request may ask for at most {MAX_CHOICES} choices (n times the number of prompts); "
            f"this one asks for {total}.",
            param="n",
        )
    return items


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: the request's for j = 0 and when unseeded, else a distinct one from (seed, j)."""
    if seed is None or j == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{j}".encode(), digest_size=8).digest(), "big")


def plan_choices(
    ctx: GatewayContext, request: Request, call: Call, resolved: Resolved, items: Sequence[Any], n: int
) -> list[ChoicePlan]:
    """Every choice of the request, in answer order: each prompt tokenized (and refused) on its own."""
    tok = ctx.tokenizers.get(resolved.model_dir)
    calls = [call] if call.chat else [replace(call, body={**call.body, "prompt": item}) for item in items]
    prompts = [tokenize(ctx, c, resolved) for c in calls]
    base = make_job(ctx, request, call, resolved, prompts[0])  # the client's id, once for all
    total = len(prompts) * n
    plans = []
    for p, (one_call, prompt) in enumerate(zip(calls, prompts, strict=True)):
        spec = render_spec(one_call, tok, prompt)
        for j in range(n):
            mine = replace(prompt, params=replace(prompt.params, seed=choice_seed(prompt.params.seed, j)))
            index = p * n + j
            plans.append(ChoicePlan(index, p, p * n, choice_job(base, index, total, mine), mine, spec))
    return plans


def choices_usage(plans: Sequence[ChoicePlan], last: Mapping[int, OutputEvent]) -> dict[str, Any]:
    """The answer's usage: each prompt's tokens once (and its best prefix-cache hit among its choices),
    every choice's completion tokens."""
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    for plan in plans:
        event, p = last[plan.index], plan.prompt_index
        prompt_tokens[p] = max(prompt_tokens.get(p, 0), event.prompt_tokens)
        cached[p] = max(cached.get(p, 0), event.cached_tokens)
    completion = sum(last[plan.index].completion_tokens for plan in plans)
    return protocol.usage(sum(prompt_tokens.values()), completion, sum(cached.values()))
