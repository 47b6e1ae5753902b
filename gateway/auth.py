"""API keys → tenants, and the admin token.

Keys come from the config file (plain) or from the admin API, which stores only their SHA-256 in Redis
(`lg:keys`), so a leaked Redis dump holds no usable key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import redis.asyncio as aioredis
from starlette.requests import Request

from gateway.errors import APIError
from gateway.settings import GatewaySettings
from loragate import contracts


def key_digest(api_key: str) -> str:
    # Header values arrive as latin-1 text (any byte is a character), which UTF-8 always encodes.
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    return "sk-lg-" + secrets.token_urlsafe(24)


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Authenticator:
    def __init__(self, settings: GatewaySettings, r: aioredis.Redis):
        self.settings, self.redis = settings, r

    async def tenant(self, request: Request) -> str:
        token = bearer(request)
        if token is None:
            raise APIError(
                401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )
        for key, tenant in self.settings.api_keys.items():
            if hmac.compare_digest(key.encode(), token.encode()):  # bytes: str refuses non-ASCII
                return tenant
        stored = await self.redis.hget(contracts.API_KEYS, key_digest(token))
        if stored is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return stored.decode() if isinstance(stored, bytes) else str(stored)

    def require_admin(self, request: Request) -> None:
        token = bearer(request)
        admin = self.settings.admin_token
        if admin is None:
            raise APIError(403, "The admin API is disabled: no admin token is configured.")
        if token is None or not hmac.compare_digest(token.encode(), admin.encode()):
            raise APIError(401, "Invalid admin token.", code="invalid_api_key")
