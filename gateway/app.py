"""The gateway ASGI app: routes, error handling and the lifespan that owns Redis and background tasks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from opentelemetry.instrumentation.starlette import StarletteInstrumentor
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Tracer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import openapi
from gateway.admin_api import AdminRoutes
from gateway.admin_policy import PolicyRoutes
from gateway.admission import FairAdmission
from gateway.auth import Authenticator
from gateway.context import GatewayContext
from gateway.decisions import DecisionLog
from gateway.errors import APIError, queue_unavailable
from gateway.fleet import Fleet
from gateway.kv_events import KVEventFollower
from gateway.metrics import GatewayMetrics
from gateway.model_catalog import ModelCatalog
from gateway.openai_api import OpenAIRoutes
from gateway.overload import Limits
from gateway.policy_store import PolicyHolder, PolicyStore
from gateway.read_limits import ReadLimits
from gateway.reaper import Reaper
from gateway.relay import OutputMux
from gateway.relay_cluster import ClusterOutputMux
from gateway.routing import Router
from gateway.scaling_api import ScalingRoutes
from gateway.settings import GatewaySettings
from gateway.tokenize import TokenizerStore
from gateway.tokenize_api import TokenizeRoutes
from loragate.redis_retry import is_outage
from loragate.redis_url import connect_async, is_cluster
from loragate.tracing import make_provider
from policies.default_policy import DEFAULT_POLICY
from policies.document import Policy, parse_policy

log = logging.getLogger("loragate.gateway")
Endpoint = Callable[[Request], Awaitable[Response]]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(
        exc.status_code, str(exc.detail) or "Request failed.", headers=dict(exc.headers or {})
    ).response()


async def _redis_error(request: Request, exc: Exception) -> Response:
    log.warning("Redis error on %s: %s", request.url.path, exc)
    return queue_unavailable().response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, "Internal server error.", type_="server_error").response()


@asynccontextmanager
async def gateway_context(
    settings: GatewaySettings, tracer: Tracer | None = None
) -> AsyncIterator[GatewayContext]:
    r = connect_async(settings.redis_url, max_connections=256)
    fleet = Fleet(r)
    try:
        await fleet.refresh()
    except Exception as e:  # Redis not up yet: serve 503s and let the fleet loop retry
        if not is_outage(e):
            raise
        log.warning("Redis is unreachable at start-up (%r); serving 503 until it is back", e)
    fleet.start()
    mux: OutputMux | ClusterOutputMux = (
        ClusterOutputMux(settings.redis_url, r)
        if is_cluster(settings.redis_url)
        else OutputMux(settings.redis_url, r)
    )
    await mux.start()
    reaper = Reaper(r, fleet, f"reaper-{settings.gateway_id}", shared_queue=settings.model_queue_max > 0)
    reaper.start()
    holder: PolicyHolder[Policy] = PolicyHolder(
        PolicyStore(r), parse_policy, DEFAULT_POLICY, settings.redis_url
    )
    await holder.start()
    kv_events = KVEventFollower(settings.redis_url, r, fleet.state.index)
    kv_events.start()
    metrics = GatewayMetrics(fleet)
    decisions = DecisionLog(r, metrics)
    admission = FairAdmission.from_settings(fleet, settings)
    try:
        yield GatewayContext(
            settings,
            r,
            fleet,
            ModelCatalog(r, fleet),
            Authenticator(settings, r),
            mux,
            reaper,
            TokenizerStore(),
            holder,
            Router(fleet.state, holder, decisions, shared_queue=settings.model_queue_max > 0),
            decisions,
            admission,
            kv_events,
            metrics,
            tracer,
        )
    finally:
        await admission.stop()
        await kv_events.stop()
        await holder.stop()
        await reaper.stop()
        await mux.stop()
        await fleet.stop()
        await r.aclose()


def create_app(settings: GatewaySettings, span_exporter: SpanExporter | None = None) -> Starlette:
    """The app; traces go to `span_exporter` (tests) or as the `OTEL_*` environment says (off if unset)."""
    Limits.from_settings(settings)  # a bad admission bound fails here, before the server starts
    holder: dict[str, GatewayContext] = {}
    provider = make_provider("loragate-gateway", span_exporter)
    tracer = provider.get_tracer("loragate.gateway") if provider is not None else None

    def ctx() -> GatewayContext:
        return holder["ctx"]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with gateway_context(settings, tracer) as context:
            holder["ctx"] = context
            try:
                yield
            finally:
                if provider is not None:
                    provider.shutdown()  # flush the spans still batched

    async def health(request: Request) -> Response:
        live = [w for w in ctx().fleet.workers.values() if not w.state.draining]
        body = {
            "status": "ok" if live else "unavailable",
            "workers": len(live),
            "models": sorted({w.state.model for w in live}),
        }
        return JSONResponse(body, status_code=200 if live else 503)

    def bind(cls: type, name: str) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            handler: Endpoint = getattr(cls(ctx()), name)
            return await handler(request)

        return endpoint

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi.document(ctx().fleet.models()))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(ctx().metrics.registry), media_type=CONTENT_TYPE_LATEST)

    o, a, p, t, sc = OpenAIRoutes, AdminRoutes, PolicyRoutes, TokenizeRoutes, ScalingRoutes
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", bind(sc, "ready"), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/v1/models", bind(o, "models"), methods=["GET"]),
        Route("/v1/models/{model:path}", bind(o, "model"), methods=["GET"]),  # ids may hold "/" (org/name)
        Route("/v1/completions", bind(o, "completions"), methods=["POST"]),
        Route("/v1/chat/completions", bind(o, "chat_completions"), methods=["POST"]),
        Route("/tokenize", bind(t, "tokenize"), methods=["POST"]),
        Route("/detokenize", bind(t, "detokenize"), methods=["POST"]),
        Route("/admin/workers", bind(a, "workers"), methods=["GET"]),
        Route("/admin/models/{model}/demand", bind(sc, "demand"), methods=["GET"]),
        Route("/admin/adapters", bind(a, "list_adapters"), methods=["GET"]),
        Route("/admin/adapters/{base}/{name}", bind(a, "put_adapter"), methods=["PUT"]),
        Route("/admin/adapters/{base}/{name}", bind(a, "delete_adapter"), methods=["DELETE"]),
        Route("/admin/adapters/{base}/{name}/pin", bind(a, "pin_adapter"), methods=["POST"]),
        Route("/admin/keys", bind(a, "create_key"), methods=["POST"]),
        Route("/admin/keys", bind(a, "list_keys"), methods=["GET"]),
        Route("/admin/keys/{key_id}", bind(a, "delete_key"), methods=["DELETE"]),
        Route("/admin/policy", bind(p, "get_policy"), methods=["GET"]),
        Route("/admin/policy", bind(p, "put_policy"), methods=["PUT"]),
        Route("/admin/policy/history", bind(p, "history"), methods=["GET"]),
        Route("/admin/policy/rollback", bind(p, "rollback"), methods=["POST"]),
        Route("/admin/policy/shadow", bind(p, "get_shadow"), methods=["GET"]),
        Route("/admin/policy/shadow", bind(p, "put_shadow"), methods=["PUT"]),
        Route("/admin/policy/shadow", bind(p, "delete_shadow"), methods=["DELETE"]),
        Route("/admin/policy/stats", bind(p, "stats"), methods=["GET"]),
        Route("/admin/decisions/{decision_id}", bind(p, "decision"), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(ReadLimits, settings.max_body_bytes, settings.body_timeout_s)],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            RedisError: _redis_error,
            Exception: _unexpected,
        },
    )
    if provider is not None:
        StarletteInstrumentor.instrument_app(app, tracer_provider=provider)
    return app
