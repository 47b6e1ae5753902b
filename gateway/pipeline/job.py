"""Stage job: the request's identity and the message a worker will run. The client's id (its
`X-Request-Id`, or one made here) names, inside loragate, the tenant-scoped request
(`contracts.scoped_request_id`); its record in Redis (`gateway.request_store`) lets a retry attach.

A request of several choices (`n`, or a list of prompts) is one job per choice (`choice_job`): all answer
under the client's id, and each runs as its own scoped request, `{scoped id}~{index}` (`~` never occurs in
a client id, so no client id names a choice) — choice 0 keeps the scoped id itself, so a retry that asks
for a different number of choices than the first try finds choice 0 asked differently (409)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace

from starlette.requests import Request

from gateway.context import GatewayContext
from gateway.errors import bad_request
from gateway.pipeline.parse import Call
from gateway.pipeline.prompt import Prompt
from gateway.pipeline.resolve import Resolved
from gateway.request_store import RequestStore, fingerprint
from loragate import contracts
from loragate.messages import QueuedRequest
from loragate.tracing import inject

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{8,128}$")
CHOICE_SEP = "~"  # between a scoped request id and a choice's index: never in a client's id


@dataclass(frozen=True)
class Job:
    request_id: str  # the client's
    given_id: bool  # the client sent it (a retry is possible)
    message: QueuedRequest  # request_id inside: the tenant-scoped one
    fingerprint: str  # what was asked: a retry must ask the same
    store: RequestStore

    @property
    def qid(self) -> str:
        return self.message.request_id

    async def is_retry(self, ctx: GatewayContext) -> bool:
        """A retry of a request that is still live (queued, running, or its output kept)."""
        if not self.given_id:
            return False
        async with asyncio.timeout(ctx.settings.redis_timeout_s):
            return await self.store.exists(self.qid, self.fingerprint)


def make_job(ctx: GatewayContext, request: Request, call: Call, resolved: Resolved, prompt: Prompt) -> Job:
    rid = request_id(request.headers, call.chat)
    target = resolved.target
    message = QueuedRequest(
        contracts.scoped_request_id(call.tenant, rid),
        target.base,
        prompt.token_ids,
        prompt.params,
        adapter=target.adapter.key if target.adapter else None,
        tenant=call.tenant,
        traceparent=inject(call.server_span),
        operation=call.operation,
    )
    ttl = int(ctx.settings.request_timeout_s) + contracts.REQUEST_RECORD_GRACE_S
    given = "x-request-id" in request.headers
    return Job(rid, given, message, fingerprint(message), RequestStore(ctx.redis, ttl, target.base))


def choice_job(job: Job, index: int, choices: int, prompt: Prompt) -> Job:
    """Choice `index` of `choices` of `job`'s request, asking `prompt` (its own tokens and sampling). Its
    fingerprint names its place among the choices, so a retry must ask for the same choices."""
    qid = job.qid if index == 0 else f"{job.qid}{CHOICE_SEP}{index}"
    message = replace(job.message, request_id=qid, prompt_token_ids=prompt.token_ids, params=prompt.params)
    place = f"{fingerprint(message)}:{index}/{choices}"
    return replace(job, message=message, fingerprint=hashlib.sha256(place.encode()).hexdigest()[:32])


def request_id(headers: Mapping[str, str], chat: bool) -> str:
    """The client's `X-Request-Id` (checked), or a new OpenAI-style id."""
    given = headers.get("x-request-id")
    if given is None:
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if not _REQUEST_ID.match(given):
        raise bad_request("X-Request-Id must be 8-128 characters of letters, digits, '.', '_', ':' or '-'.")
    return given
