"""Stage resolve: the base model (and adapter) to serve, and its live workers. A model alias (`auto`)
goes up the policy's alias ladder by difficulty; anything else through the model catalog."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.fleet import WorkerView
from gateway.model_catalog import ModelShape, Target
from gateway.pipeline.parse import Call
from gateway.routing import AliasChoice


@dataclass(frozen=True)
class Resolved:
    target: Target
    alias: AliasChoice | None  # how an alias was resolved (None: no alias asked)
    serving: tuple[WorkerView, ...]  # empty only when the request may wait for a worker (`model_queue_max`)
    shape: ModelShape

    @staticmethod
    def of(target: Target, alias: AliasChoice | None, serving: tuple[WorkerView, ...]) -> Resolved:
        """Served by `serving` (at least one): the model as its workers describe it."""
        first = serving[0].state
        max_len = min(w.state.max_model_len for w in serving)
        return Resolved(target, alias, serving, ModelShape(first.model_dir, first.block_size, max_len))

    @property
    def model_dir(self) -> str:
        """Names the tokenizer."""
        return self.shape.model_dir

    @property
    def block_size(self) -> int:
        """The prefix hashes' block size."""
        return self.shape.block_size

    @property
    def max_model_len(self) -> int:
        return self.shape.max_model_len


async def resolve(ctx: GatewayContext, call: Call) -> Resolved:
    """The target and its workers; with none live, 503 — unless the model's shared stream is on and the
    model known: then the request waits there for the first worker to start (scale from zero)."""
    async with asyncio.timeout(ctx.settings.redis_timeout_s):
        target, alias = await _target(ctx, call)
    serving = ctx.fleet.serving(target.base)
    if serving:
        return Resolved.of(target, alias, tuple(serving))
    if ctx.settings.model_queue_max > 0:
        async with asyncio.timeout(ctx.settings.redis_timeout_s):
            shape = await ctx.catalog.shape(target.base)
        if shape is not None:
            return Resolved(target, alias, (), shape)
    raise no_worker(target.base, "right now")


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
