"""What an orchestrator needs from the gateway: readiness, and each base model's demand for workers.

- `GET /ready`: 200 while this gateway can take requests — Redis answers — whether or not a worker is
  live (`/health` is 503 with no worker, which is normal for a model scaled to zero: a readiness probe on
  it would take every gateway out of its Service, and no request would ever wait for the first worker).
- `GET /admin/models/{model}/demand` (admin token): the model's outstanding requests, read from Redis so
  every gateway answers the same: those on its live workers' queues (running or waiting there; an entry
  is deleted when its request ends) plus those waiting on its shared stream for any worker
  (`contracts.model_queue`). `demand` is their sum: what an autoscaler divides by the load one worker
  should carry (KEDA's `metrics-api` trigger, `valueLocation: demand`), so the model keeps its workers
  while they are busy, scales out before the shared stream fills, and only goes to zero when idle. 404
  for a model the fleet never served.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.context import GatewayContext
from gateway.errors import APIError
from loragate import contracts


class ScalingRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx

    async def ready(self, request: Request) -> Response:
        try:
            async with asyncio.timeout(self.ctx.settings.redis_timeout_s):
                await self.ctx.redis.ping()
        except Exception:  # unreachable, timed out, or refusing: not ready, never a 500
            return JSONResponse({"status": "unavailable", "redis": False}, status_code=503)
        return JSONResponse({"status": "ready", "redis": True})

    async def demand(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        model = request.path_params["model"]
        async with asyncio.timeout(self.ctx.settings.redis_timeout_s):
            await self.ctx.fleet.refresh()
            waiting = int(await self.ctx.redis.xlen(contracts.model_queue(model)))
            known = model in self.ctx.fleet.models() or model in await self.ctx.catalog.remembered()
        if not known and not waiting:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        views = [w for w in self.ctx.fleet.workers.values() if w.state.model == model]
        outstanding = sum(w.queue_len for w in views)
        return JSONResponse(
            {
                "model": model,
                "workers": sum(not w.state.draining for w in views),
                "outstanding": outstanding,
                "waiting_for_worker": waiting,
                "demand": outstanding + waiting,
            }
        )
