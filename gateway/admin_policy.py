"""Admin endpoints for the routing policy: view, replace (validated), history, rollback, shadow, and the
decisions and their statistics.

A bad document is refused with 400 naming the path of the bad field (`plugins[2].parameters.k`); a good
one becomes the next version and every gateway applies it within a second.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.context import GatewayContext
from gateway.errors import APIError, bad_request
from policies.document import parse_policy
from policies.framework import PolicyError


async def _document(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > 256 * 1024:
        raise APIError(413, "Policy document too large (256 KiB at most).", code="request_too_large")
    try:
        doc = yaml.safe_load(raw) if "yaml" in request.headers.get("content-type", "") else json.loads(raw)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise bad_request(f"The policy document does not parse: {e}.") from e
    if not isinstance(doc, dict):
        raise bad_request("The policy document must be an object.")
    try:
        parse_policy(doc)
    except PolicyError as e:
        raise APIError(
            400, f"Invalid policy: {e.path}: {e.message}", param=e.path, code="invalid_policy"
        ) from e
    return doc


class PolicyRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx

    async def get_policy(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        holder = self.ctx.policy
        await holder.reload()
        return JSONResponse({"version": holder.version, "document": holder.document})

    async def put_policy(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        doc = await _document(request)
        version = await self.ctx.policy.store.put(doc, note=request.query_params.get("note", ""))
        await self.ctx.policy.reload()
        return JSONResponse({"version": version}, status_code=201)

    async def history(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        return JSONResponse({"versions": await self.ctx.policy.store.history()})

    async def rollback(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        body = json.loads(await request.body() or b"{}")
        version = body.get("version") if isinstance(body, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            raise bad_request("'version' must be an integer.", param="version")
        new = await self.ctx.policy.store.rollback(version)
        if new is None:
            raise APIError(404, f"No policy version {version}.", code="policy_version_not_found")
        await self.ctx.policy.reload()
        return JSONResponse({"version": new, "rolled_back_to": version}, status_code=201)

    async def get_shadow(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        await self.ctx.policy.reload()
        return JSONResponse(
            {"document": self.ctx.policy.shadow_document, "report": self.ctx.decisions.shadow.report()}
        )

    async def put_shadow(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        doc = await _document(request)
        await self.ctx.policy.store.set_shadow(doc)
        await self.ctx.policy.reload()
        self.ctx.decisions.reset_shadow()
        return JSONResponse({"shadow": True}, status_code=201)

    async def delete_shadow(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        await self.ctx.policy.store.set_shadow(None)
        await self.ctx.policy.reload()
        return Response(status_code=204)

    async def decision(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        found = await self.ctx.decisions.get(request.path_params["decision_id"])
        if found is None:
            raise APIError(404, "No such decision (they are kept for an hour).", code="decision_not_found")
        return JSONResponse(found)

    async def stats(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        return JSONResponse(
            {
                **self.ctx.decisions.stats(),
                "admission_waited": self.ctx.admission.waited,
                "kv_events_applied": self.ctx.kv_events.applied,
            }
        )
