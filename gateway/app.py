"""The gateway ASGI app: routes, error handling and the lifespan that owns Redis and background tasks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin_api import AdminRoutes
from gateway.auth import Authenticator
from gateway.catalog import Catalog
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.fleet import Fleet
from gateway.openai_api import OpenAIRoutes
from gateway.prefix_index import ApproxPrefixIndex
from gateway.reaper import Reaper
from gateway.relay import OutputMux
from gateway.router import pick_worker
from gateway.settings import GatewaySettings
from gateway.tokenize import TokenizerStore
from loragate.redis_url import connect_async

log = logging.getLogger("loragate.gateway")
Endpoint = Callable[[Request], Awaitable[Response]]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(exc.status_code, str(exc.detail) or "Request failed.").response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, "Internal server error.", type_="server_error").response()


def create_app(settings: GatewaySettings) -> Starlette:
    holder: dict[str, GatewayContext] = {}

    def ctx() -> GatewayContext:
        return holder["ctx"]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        r = connect_async(settings.redis_url, max_connections=256)
        fleet = Fleet(r)
        await fleet.refresh()
        fleet.start()
        mux = OutputMux(settings.redis_url, r)
        await mux.start()
        reaper = Reaper(
            r, fleet, lambda t: pick_worker(fleet, t, max_queue=2**62), f"reaper-{settings.gateway_id}"
        )
        reaper.start()
        holder["ctx"] = GatewayContext(
            settings,
            r,
            fleet,
            Catalog(r, fleet),
            Authenticator(settings, r),
            mux,
            reaper,
            TokenizerStore(),
            ApproxPrefixIndex(),
        )
        try:
            yield
        finally:
            await reaper.stop()
            await mux.stop()
            await fleet.stop()
            await r.aclose()

    async def health(request: Request) -> Response:
        live = [w for w in ctx().fleet.workers.values() if not w.state.draining]
        body = {
            "status": "ok" if live else "unavailable",
            "workers": len(live),
            "models": sorted({w.state.model for w in live}),
        }
        return JSONResponse(body, status_code=200 if live else 503)

    def openai(name: str) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            handler: Endpoint = getattr(OpenAIRoutes(ctx()), name)
            return await handler(request)

        return endpoint

    def admin(name: str) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            handler: Endpoint = getattr(AdminRoutes(ctx()), name)
            return await handler(request)

        return endpoint

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", openai("models"), methods=["GET"]),
        Route("/v1/completions", openai("completions"), methods=["POST"]),
        Route("/v1/chat/completions", openai("chat_completions"), methods=["POST"]),
        Route("/admin/workers", admin("workers"), methods=["GET"]),
        Route("/admin/adapters", admin("list_adapters"), methods=["GET"]),
        Route("/admin/adapters/{base}/{name}", admin("put_adapter"), methods=["PUT"]),
        Route("/admin/adapters/{base}/{name}", admin("delete_adapter"), methods=["DELETE"]),
        Route("/admin/adapters/{base}/{name}/pin", admin("pin_adapter"), methods=["POST"]),
        Route("/admin/keys", admin("create_key"), methods=["POST"]),
        Route("/admin/keys", admin("list_keys"), methods=["GET"]),
        Route("/admin/keys/{key_id}", admin("delete_key"), methods=["DELETE"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
