"""Connect to Redis from a URL (`redis://`, `rediss://`, `unix://`), defaulting to `$REDIS_URL`.

A client may retry a failed command once, at once: after a Redis restart every pooled connection is stale
and its first command fails, the retry reconnects. But a command whose reply was lost (a timeout, a
connection dropped after the server ran it) has perhaps run, and a retry runs it again: only clients whose
commands are all idempotent retry (the gateway's, whose writes are scripts that check first; the worker's
heartbeat). The worker's engine client does not: a transaction of output events run twice would stream
tokens twice, and a re-sync (`worker.ledger`) repairs whatever a failed command left. Longer outages are
not retried here, where a caller would block for seconds, but in each process's loops
(`loragate.redis_retry`), which back off and re-announce.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

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


def retry_once() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), 1)


def async_retry_once() -> AsyncRetry:
    return AsyncRetry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), 1)


def no_retry() -> Retry:
    return Retry(NoBackoff(), 0)  # redis-py's default (`retry=None`) would retry 3 times


def connect_sync(url: str | None, socket_timeout: float = 10.0, idempotent: bool = False) -> redis.Redis:
    """A blocking client (the worker's). Its reads are short (`BLOCK` ≤ 100 ms), so a socket timeout bounds
    how long a server that stopped answering (without closing the connection) can hold a thread. It
    retries a failed command only if the caller says that every command it sends may run twice."""
    return redis.Redis.from_url(
        resolve(url),
        retry=retry_once() if idempotent else no_retry(),
        socket_timeout=socket_timeout,
        socket_connect_timeout=2.0,
    )


def async_options(url: str) -> dict[str, Any]:
    """Connection options for the asyncio clients.

    No socket timeout: with one, redis-py (on Python 3.11) sends every command through
    `asyncio.wait_for`, i.e. in a new Task one event-loop turn later, which is on the path of every
    request. Callers bound the waits that matter themselves (the gateway: `redis_timeout_s`), blocking
    reads end by their own BLOCK time, and over TCP keepalive probes notice a server that vanished.
    """
    options: dict[str, Any] = {"socket_timeout": None, "retry": async_retry_once()}
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
    """A client on one dedicated connection (a blocking reader). It does not retry: its owner must see
    every reconnect, since the connection's `CLIENT ID` (and perhaps the server) changes with it."""
    options = async_options(url) | {"retry": AsyncRetry(NoBackoff(), 0)}
    return aioredis.Redis.from_url(url, single_connection_client=True, **options)
