"""API keys → tenants: configured keys, keys the admin API stored as digests (on a real Redis), and the
admin token; every refusal is 401 (or 403 with no admin token configured)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import redis.asyncio as aioredis
from starlette.requests import Request

from gateway.auth import Authenticator, bearer, key_digest, new_api_key
from gateway.errors import APIError
from gateway.settings import GatewaySettings
from loragate import contracts


def _request(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode("latin-1"))]
    return Request({"type": "http", "headers": headers})


@pytest.mark.parametrize(
    ("header", "token"),
    [
        pytest.param("Bearer sk-1", "sk-1", id="bearer"),
        pytest.param("bearer sk-1", "sk-1", id="scheme is case-insensitive"),
        pytest.param("Bearer   sk-1  ", "sk-1", id="spaces around the token"),
        pytest.param(None, None, id="no header"),
        pytest.param("", None, id="empty header"),
        pytest.param("Bearer", None, id="scheme only"),
        pytest.param("Bearer    ", None, id="blank token"),
        pytest.param("Basic dXNlcjpwdw==", None, id="another scheme"),
        pytest.param("sk-1", None, id="token without scheme"),
    ],
)
def test_bearer(header: str | None, token: str | None) -> None:
    assert bearer(_request(header)) == token


def test_key_digest_is_sha256_hex() -> None:
    assert key_digest("sk-x") == hashlib.sha256(b"sk-x").hexdigest()
    assert key_digest("ÿ") == hashlib.sha256("ÿ".encode()).hexdigest()  # a latin-1 header character


def test_new_api_keys_are_prefixed_and_distinct() -> None:
    keys = {new_api_key() for _ in range(50)}
    assert len(keys) == 50 and all(k.startswith("sk-lg-") and len(k) == 38 for k in keys)


SETTINGS = GatewaySettings(redis_url="unused", admin_token="admin-t", api_keys={"sk-conf": "team-a"})


def _tenant(redis_url: str, header: str | None, settings: GatewaySettings = SETTINGS) -> str:
    async def main() -> str:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            await r.hset(contracts.API_KEYS, key_digest("sk-stored"), "team-b")
            return await Authenticator(settings, r).tenant(_request(header))
        finally:
            await r.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("header", "tenant"),
    [
        pytest.param("Bearer sk-conf", "team-a", id="a configured key"),
        pytest.param("Bearer sk-stored", "team-b", id="a key stored by the admin API"),
    ],
)
def test_tenant_of_a_known_key(redis_url: str, header: str, tenant: str) -> None:
    assert _tenant(redis_url, header) == tenant


@pytest.mark.parametrize(
    ("header", "message"),
    [
        pytest.param(None, "Missing API key", id="no key"),
        pytest.param("Bearer sk-unknown", "Incorrect API key", id="unknown key"),
        pytest.param("Bearer sk-cönf", "Incorrect API key", id="non-ASCII key"),
        pytest.param(f"Bearer {key_digest('sk-stored')}", "Incorrect API key", id="the digest itself"),
    ],
)
def test_unknown_keys_are_401(redis_url: str, header: str | None, message: str) -> None:
    with pytest.raises(APIError) as e:
        _tenant(redis_url, header)
    assert (e.value.status, e.value.code) == (401, "invalid_api_key") and message in e.value.message


@pytest.mark.parametrize(
    ("admin_token", "header", "status"),
    [
        pytest.param("admin-t", "Bearer admin-t", None, id="the token"),
        pytest.param("admin-t", "Bearer admin-x", 401, id="a wrong token"),
        pytest.param("admin-t", "Bearer sk-conf", 401, id="an API key"),
        pytest.param("admin-t", None, 401, id="no token"),
        pytest.param(None, "Bearer admin-t", 403, id="admin API disabled"),
    ],
)
def test_require_admin(admin_token: str | None, header: str | None, status: int | None) -> None:
    settings = GatewaySettings(redis_url="unused", admin_token=admin_token)
    auth = Authenticator(settings, aioredis.Redis())  # never called: no Redis I/O
    if status is None:
        auth.require_admin(_request(header))
        return
    with pytest.raises(APIError) as e:
        auth.require_admin(_request(header))
    assert e.value.status == status
