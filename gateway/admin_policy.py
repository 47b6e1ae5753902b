"""Admin endpoints for the routing policy: view, replace (validated), history, rollback, shadow, and the
decisions and their statistics.

A bad document is refused with 400 naming the path of the bad field (`plugins[2].parameters.k`); a good
one becomes the next version and every gateway applies it within a second.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.context import GatewayContext, read_json
from gateway.errors import APIError, bad_request
from gateway.limits import MAX_DEPTH, check_tree, parse_json, read_body
from policies.document import parse_policy
from policies.framework import PolicyError

log = logging.getLogger("loragate.gateway")


_MAX_DOCUMENT = 256 * 1024


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a few hundred bytes of nested aliases expand to gigabytes once
    the document is copied or stored as JSON."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("aliases (*name) are not allowed in a policy document")
        return super().compose_node(parent, index)


def _load(raw: bytes, content_type: str) -> Any:
    if "yaml" not in content_type:
        return parse_json(raw)
    try:
        doc = yaml.load(raw, Loader=_NoAliasLoader)  # a SafeLoader subclass
    except RecursionError:
        raise bad_request(f"The policy document nests deeper than {MAX_DEPTH} levels.") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an int of more than 4,300 digits
        raise bad_request(f"The policy document does not parse: {e}.", code="invalid_yaml") from None
    check_tree(doc, json_types_only=True)  # dates, sets, binary: nothing the store could save as JSON
    return doc


async def _document(request: Request) -> dict[str, Any]:
    doc = _load(await read_body(request, _MAX_DOCUMENT), request.headers.get("content-type", ""))
    if not isinstance(doc, dict):
        raise bad_request("The policy document must be an object.", code="invalid_policy")
    try:
        parse_policy(doc)
    except PolicyError as e:
        raise APIError(
            400, f"Invalid policy: {e.path}: {e.message}", param=e.path or None, code="invalid_policy"
        ) from e
    except Exception as e:  # a validator that trips over a malformed document: still the document's fault
        log.warning("policy validation failed unexpectedly: %r", e)
        raise APIError(400, f"Invalid policy: {e}", code="invalid_policy") from e
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
        body = await read_json(request, 4096, empty_ok=True)
        version = body.get("version")
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
