"""Connect to Redis from a URL (`redis://`, `rediss://`, `unix://`), defaulting to `$REDIS_URL`."""

from __future__ import annotations

import os

import redis
import redis.asyncio as aioredis


def resolve(url: str | None) -> str:
    resolved = url or os.environ.get("REDIS_URL")
    if not resolved:
        raise SystemExit("no Redis: pass --redis URL or set REDIS_URL (`loragate up` starts one for you)")
    return resolved


def connect_sync(url: str | None) -> redis.Redis:
    return redis.Redis.from_url(resolve(url))


def connect_async(url: str | None, max_connections: int = 64, wait_s: float = 30.0) -> aioredis.Redis:
    """A client whose pool makes callers wait for a free connection (up to `wait_s`) instead of failing
    when thousands of concurrent requests touch Redis at once."""
    pool = aioredis.BlockingConnectionPool.from_url(
        resolve(url), max_connections=max_connections, timeout=wait_s
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() disconnects it
