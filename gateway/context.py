"""Everything a request handler needs, built once per gateway process by the app's lifespan."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from opentelemetry.trace import Tracer
from starlette.requests import Request

from gateway.admission import FairAdmission
from gateway.auth import Authenticator
from gateway.catalog import Catalog
from gateway.decisions import DecisionLog
from gateway.errors import APIError, bad_request
from gateway.fleet import Fleet
from gateway.kv_events import KVEventFollower
from gateway.metrics import GatewayMetrics
from gateway.policy_store import PolicyHolder
from gateway.reaper import Reaper
from gateway.relay import OutputMux
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.tokenize import TokenizerStore
from policies.document import Policy


@dataclass
class GatewayContext:
    settings: GatewaySettings
    redis: aioredis.Redis
    fleet: Fleet
    catalog: Catalog
    auth: Authenticator
    mux: OutputMux
    reaper: Reaper
    tokenizers: TokenizerStore
    policy: PolicyHolder[Policy]
    router: Router
    decisions: DecisionLog
    admission: FairAdmission
    kv_events: KVEventFollower
    metrics: GatewayMetrics
    tracer: Tracer | None = None


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(
            413, f"Request body too large ({length} bytes; the limit is {limit}).", code="request_too_large"
        )
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise APIError(
                413, f"Request body too large (the limit is {limit} bytes).", code="request_too_large"
            )
    try:
        body = json.loads(chunks)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}.") from e
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body
