"""Stage resolve: the base model (and adapter) to serve, and its live workers. A model alias (`auto`)
goes up the policy's alias ladder by difficulty; anything else through the model catalog."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.fleet import WorkerView
from gateway.model_catalog import Target
from gateway.pipeline.parse import Call
from gateway.routing import AliasChoice
from loragate.messages import WorkerState


@dataclass(frozen=True)
class Resolved:
    target: Target
    alias: AliasChoice | None  # how an alias was resolved (None: no alias asked)
    serving: tuple[WorkerView, ...]  # at least one

    @property
    def worker_state(self) -> WorkerState:
        """A serving worker's state: its model directory names the tokenizer, its block size the hashes."""
        return self.serving[0].state

    @property
    def max_model_len(self) -> int:
        return min(w.state.max_model_len for w in self.serving)


async def resolve(ctx: GatewayContext, call: Call) -> Resolved:
    async with asyncio.timeout(ctx.settings.redis_timeout_s):
        target, alias = await _target(ctx, call)
    serving = ctx.fleet.serving(target.base)
    if not serving:
        raise no_worker(target.base, "right now")
    return Resolved(target, alias, tuple(serving))


async def _target(ctx: GatewayContext, call: Call) -> tuple[Target, AliasChoice | None]:
    model = call.parsed.model
    if isinstance(model, str) and ctx.router.is_alias(model):
        choice = ctx.router.resolve_alias(model, alias_text(call), call.parsed.max_tokens or 0)
        return Target(choice.model, None), choice
    return await ctx.catalog.resolve(model, call.tenant), None


def alias_text(call: Call) -> str:
    """What the difficulty estimator reads: the messages' contents, or the raw prompt."""
    if call.messages:
        return "\n".join(m["content"] for m in call.messages)
    return str(call.body.get("prompt", ""))


def no_worker(base: str, when: str) -> APIError:
    return APIError(
        503, f"No worker is serving '{base}' {when}.", code="no_worker", headers={"Retry-After": "2"}
    )
