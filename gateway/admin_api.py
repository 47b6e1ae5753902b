"""The admin API (`Authorization: Bearer <admin token>`): workers, the adapter registry, API keys.

Adapter names and bases are plain identifiers, and a registered path must resolve (symlinks followed)
inside one of the configured `adapter_roots` and hold an `adapter_config.json`: the API can never make a
worker read outside the roots.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.auth import key_digest, new_api_key
from gateway.context import GatewayContext, read_json
from gateway.errors import APIError, bad_request
from loragate import contracts
from loragate.messages import AdapterRecord

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise bad_request(f"Invalid {what}: use 1-64 letters, digits, '.', '_' or '-'.", param=what)
    return value


class AdminRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx

    async def workers(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        await self.ctx.fleet.refresh()
        return JSONResponse(
            {
                "workers": [
                    {**_asdict(w.state), "queue_len": w.queue_len} for w in self.ctx.fleet.workers.values()
                ]
            }
        )

    async def list_adapters(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        records = await self.ctx.catalog.adapters(fresh=True)
        return JSONResponse({"adapters": [_asdict(r) for r in sorted(records.values(), key=lambda r: r.key)]})

    async def put_adapter(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        base = _name(request.path_params["base"], "base")
        name = _name(request.path_params["name"], "name")
        body = await read_json(request, 64 * 1024)
        tenants = body.get("tenants", [])
        if not isinstance(tenants, list) or not all(isinstance(t, str) and t for t in tenants):
            raise bad_request("'tenants' must be a list of tenant names.", param="tenants")
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise bad_request("'pinned' must be a boolean.", param="pinned")
        path = self._checked_path(body.get("path"))
        record = AdapterRecord(name, base, str(path), tuple(tenants), pinned)
        await self.ctx.redis.hset(contracts.ADAPTERS, record.key, record.to_json())
        await self.ctx.catalog.adapters(fresh=True)
        return JSONResponse(_asdict(record), status_code=201)

    async def delete_adapter(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        key = f"{_name(request.path_params['base'], 'base')}:{_name(request.path_params['name'], 'name')}"
        if not await self.ctx.redis.hdel(contracts.ADAPTERS, key):
            raise APIError(404, f"No adapter '{key}' is registered.", code="adapter_not_found")
        await self.ctx.catalog.adapters(fresh=True)
        return Response(status_code=204)

    async def pin_adapter(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        key = f"{_name(request.path_params['base'], 'base')}:{_name(request.path_params['name'], 'name')}"
        body = await read_json(request, 4096)
        pinned = body.get("pinned", True)
        if not isinstance(pinned, bool):
            raise bad_request("'pinned' must be a boolean.", param="pinned")
        raw = await self.ctx.redis.hget(contracts.ADAPTERS, key)
        if raw is None:
            raise APIError(404, f"No adapter '{key}' is registered.", code="adapter_not_found")
        rec = AdapterRecord.from_json(raw)
        rec = AdapterRecord(rec.name, rec.base, rec.path, rec.tenants, pinned)
        await self.ctx.redis.hset(contracts.ADAPTERS, key, rec.to_json())
        return JSONResponse(_asdict(rec))

    async def create_key(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        body = await read_json(request, 4096)
        tenant = _name(body.get("tenant"), "tenant")
        key = new_api_key()
        await self.ctx.redis.hset(contracts.API_KEYS, key_digest(key), tenant)
        return JSONResponse({"key": key, "key_id": key_digest(key)[:16], "tenant": tenant}, status_code=201)

    async def list_keys(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        raw = await self.ctx.redis.hgetall(contracts.API_KEYS)
        return JSONResponse(
            {"keys": [{"key_id": k.decode()[:16], "tenant": v.decode()} for k, v in raw.items()]}
        )

    async def delete_key(self, request: Request) -> Response:
        self.ctx.auth.require_admin(request)
        key_id = request.path_params["key_id"]
        raw = await self.ctx.redis.hgetall(contracts.API_KEYS)
        matches = [k for k in raw if k.decode().startswith(key_id)] if len(key_id) >= 8 else []
        if len(matches) != 1:
            raise APIError(404, f"No API key with id '{key_id}'.", code="key_not_found")
        await self.ctx.redis.hdel(contracts.API_KEYS, matches[0])
        return Response(status_code=204)

    def _checked_path(self, value: object) -> Path:
        if not isinstance(value, str) or not value or "\x00" in value or len(value) > 4096:
            raise bad_request("'path' must be the adapter's directory.", param="path")
        roots = self.ctx.settings.adapter_roots
        if not roots:
            raise bad_request(
                "No adapter_roots are configured, so adapters cannot be registered.", param="path"
            )
        try:
            path = Path(value).resolve()
            if not any(path.is_relative_to(root) for root in roots):
                raise APIError(
                    403,
                    "The adapter path is outside the configured adapter roots.",
                    param="path",
                    code="path_not_allowed",
                )
            found = (path / "adapter_config.json").is_file()
        except OSError as e:  # a name too long, a symlink loop: not a directory we could use
            raise bad_request(f"The adapter path cannot be used: {e.strerror}.", param="path") from None
        if not found:
            raise bad_request("The path holds no adapter_config.json (not a PEFT adapter).", param="path")
        return path


def _asdict(obj: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(obj)
