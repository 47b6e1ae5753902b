"""Connect to Redis from a URL (`redis://`, `rediss://`, `unix://`), defaulting to `$REDIS_URL`."""

from __future__ import annotations

import os
import socket
from typing import Any

import redis
import redis.asyncio as aioredis

# Probe an idle connection after 10 s, then every 5 s; give up after 3 unanswered probes.
_KEEPALIVE = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
}


def resolve(url: str | None) -> str:
    resolved = url or os.environ.get("REDIS_URL")
    if not resolved:
        raise SystemExit("no Redis: pass --redis URL or set REDIS_URL (`loragate up` starts one for you)")
    return resolved


def connect_sync(url: str | None) -> redis.Redis:
    return redis.Redis.from_url(resolve(url))


def async_options(url: str) -> dict[str, Any]:
    """Connection options for the asyncio clients.

    No socket timeout: with one, redis-py (on Python 3.11) sends every command through
    `asyncio.wait_for`, i.e. in a new Task one event-loop turn later, which is on the path of every
    request. Callers bound the waits that matter themselves (the gateway: `redis_timeout_s`), blocking
    reads end by their own BLOCK time, and over TCP keepalive probes notice a server that vanished.
    """
    options: dict[str, Any] = {"socket_timeout": None}
    if not url.startswith("unix://"):
        options |= {"socket_keepalive": True, "socket_keepalive_options": _KEEPALIVE}
    return options


def connect_async(url: str | None, max_connections: int = 64, wait_s: float = 30.0) -> aioredis.Redis:
    """A client whose pool makes callers wait for a free connection (up to `wait_s`) instead of failing
    when thousands of concurrent requests touch Redis at once."""
    resolved = resolve(url)
    pool = aioredis.BlockingConnectionPool.from_url(
        resolved, max_connections=max_connections, timeout=wait_s, **async_options(resolved)
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() disconnects it


def connect_async_single(url: str) -> aioredis.Redis:
    """A client on one dedicated connection (a blocking reader)."""
    return aioredis.Redis.from_url(url, single_connection_client=True, **async_options(url))
