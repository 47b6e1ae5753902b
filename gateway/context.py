"""Everything a request handler needs, built once per gateway process by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from opentelemetry.trace import Tracer
from starlette.requests import Request

from gateway.admission import FairAdmission
from gateway.auth import Authenticator
from gateway.decisions import DecisionLog
from gateway.fleet import Fleet
from gateway.kv_events import KVEventFollower
from gateway.limits import read_json_object
from gateway.metrics import GatewayMetrics
from gateway.model_catalog import ModelCatalog
from gateway.policy_store import PolicyHolder
from gateway.reaper import Reaper
from gateway.relay import OutputMux
from gateway.relay_cluster import ClusterOutputMux
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.tokenize import TokenizerStore
from policies.document import Policy


@dataclass
class GatewayContext:
    settings: GatewaySettings
    redis: aioredis.Redis
    fleet: Fleet
    catalog: ModelCatalog
    auth: Authenticator
    mux: OutputMux | ClusterOutputMux
    reaper: Reaper
    tokenizers: TokenizerStore
    policy: PolicyHolder[Policy]
    router: Router
    decisions: DecisionLog
    admission: FairAdmission
    kv_events: KVEventFollower
    metrics: GatewayMetrics
    tracer: Tracer | None = None


async def read_json(request: Request, limit: int, empty_ok: bool = False) -> dict[str, Any]:
    """The body as a JSON object, read and checked within `limit` bytes (gateway/limits.py)."""
    return await read_json_object(request, limit, empty_ok)
