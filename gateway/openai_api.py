"""`/v1/completions`, `/v1/chat/completions` (streaming and not) and `/v1/models`.

A generation request goes through the stages of `gateway.pipeline`: authenticated and validated
(parse), resolved to a base model and adapter (resolve), tokenized (tokenize), given its identity (job),
admitted (admit), routed (route), enqueued on the chosen worker's stream (enqueue), and its output
stream relayed (respond, finish). The gateway waits for the first output event before answering, so
errors found by the worker (a bad adapter file) still get a proper status. Request ids are scoped to the
tenant of the key that sent them (`request_store`): another tenant's id names another request. A client
that supplies `X-Request-Id` and retries after a dropped connection gets the same generation relayed
again from the start, instead of a second generation, whether the request still waits in a queue, runs,
or has finished. A client that goes away cancels its request: dropped from its queue if no worker has
read it yet, else aborted on the worker (`gateway.pipeline.output`). A request of several choices (`n`,
a list of prompts) runs one job per choice (`gateway.pipeline.choices`, `gateway.pipeline.fanout`); one
of a single choice takes the path below, unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.context import GatewayContext
from gateway.errors import APIError, queue_unavailable
from gateway.model_catalog import AUTO
from gateway.pipeline.admit import admit
from gateway.pipeline.choices import choices_per_prompt, plan_choices, prompt_items
from gateway.pipeline.enqueue import attach, enqueue
from gateway.pipeline.fanout import ChoiceSet
from gateway.pipeline.finish import Finish, nothing_to_finish
from gateway.pipeline.job import make_job
from gateway.pipeline.parse import Call, parse
from gateway.pipeline.prompt import render_spec, tokenize
from gateway.pipeline.resolve import Resolved, resolve
from gateway.pipeline.respond import respond, respond_choices
from gateway.pipeline.route import route, route_input
from gateway.pipeline.stream import Answer

log = logging.getLogger("loragate.gateway")


class OpenAIRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx  # one instance per request

    async def completions(self, request: Request) -> Response:
        return await self._counted(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._counted(request, chat=True)

    async def _counted(self, request: Request, chat: bool) -> Response:
        try:
            try:
                return await self._generate(request, chat)
            except (RedisError, TimeoutError) as e:  # Redis down, or slower than redis_timeout_s
                log.warning("request failed on Redis: %r", e)
                raise queue_unavailable() from e
        except APIError as e:
            self.ctx.metrics.failed("unknown", None, e.status)
            raise

    async def models(self, request: Request) -> Response:
        data = await self._models(await self.ctx.auth.tenant(request))
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{model}`: one model of the list, as this key sees it; else 404."""
        data = await self._models(await self.ctx.auth.tenant(request))
        wanted = request.path_params["model"]
        found = next((m for m in data if m["id"] == wanted), None)
        if found is None:
            raise APIError(
                404, f"The model '{wanted}' does not exist.", param="model", code="model_not_found"
            )
        return JSONResponse(found)

    async def _models(self, tenant: str) -> list[dict[str, Any]]:
        """`auto`, the base models served now, and the adapters `tenant` may use."""
        now = int(time.time())
        data: list[dict[str, Any]] = [{"id": AUTO, "object": "model", "created": now, "owned_by": "loragate"}]
        bases = self.ctx.fleet.models()
        data += [{"id": b, "object": "model", "created": now, "owned_by": "loragate"} for b in sorted(bases)]
        for rec in sorted((await self.ctx.catalog.adapters()).values(), key=lambda r: r.key):
            if rec.allows(tenant):
                data.append(
                    {
                        "id": rec.key,
                        "object": "model",
                        "created": now,
                        "owned_by": "loragate",
                        "parent": rec.base,
                        "root": rec.base,
                    }
                )
        return data

    # -- the request path: gateway.pipeline's stages, in order ----------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        ctx, started = self.ctx, time.monotonic()
        call = await parse(ctx, request, chat)
        items, n = prompt_items(call), choices_per_prompt(call)
        resolved = await resolve(ctx, call)
        if len(items) * n > 1:
            return await self._choices(request, call, resolved, items, n, started)
        target, prompt = resolved.target, tokenize(ctx, call, resolved)
        spec = render_spec(call, ctx.tokenizers.get(resolved.model_dir), prompt)
        job = make_job(ctx, request, call, resolved, prompt)
        headers = {"x-request-id": job.request_id}
        if await job.is_retry(ctx):  # a retry of a request we already have: relay it again (from the start)
            reader, done = await attach(ctx, job, target.base), nothing_to_finish
        else:
            charge = await admit(ctx, request, call.tenant, target.base, prompt)
            decision, reservation = route(ctx, route_input(job, resolved, prompt), charge)
            headers["x-loragate-decision"] = decision.decision_id
            if resolved.alias is not None:
                headers["x-loragate-model"] = f"{resolved.alias.model}; difficulty {resolved.alias.score:.2f}"
            reader = await enqueue(ctx, job, decision, reservation, charge)
            done = Finish(ctx, call, job.request_id, target, decision, charge, started)
            if reader.reservation is None:  # attached to a copy queued first: that handler accounts for it
                done = nothing_to_finish
        answer = Answer(job.request_id, self._named(call, resolved), chat, call.parsed.include_usage, spec)
        return await respond(ctx, request, answer, call.parsed.stream, reader, done, headers)

    async def _choices(
        self, request: Request, call: Call, resolved: Resolved, items: list[Any], n: int, started: float
    ) -> Response:
        """Several choices: one job per choice, answered together."""
        plans = plan_choices(self.ctx, request, call, resolved, items, n)
        request_id = plans[0].job.request_id
        headers = {"x-request-id": request_id}
        if resolved.alias is not None:
            headers["x-loragate-model"] = f"{resolved.alias.model}; difficulty {resolved.alias.score:.2f}"
        choices = ChoiceSet(self.ctx, request, call, resolved, plans, started)
        answer = Answer(request_id, self._named(call, resolved), call.chat, call.parsed.include_usage)
        return await respond_choices(self.ctx, request, answer, call.parsed.stream, choices, headers)

    @staticmethod
    def _named(call: Call, resolved: Resolved) -> str:
        """The model the answer names: the one asked, or the base an alias chose."""
        target = resolved.target
        return target.model_id if call.parsed.model != AUTO and resolved.alias is None else target.base
