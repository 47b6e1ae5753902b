"""Connect to Redis from a URL (`redis://`, `rediss://`, `unix://`), defaulting to `$REDIS_URL`.

Redis Cluster: `redis+cluster://host:port` (or `rediss+cluster://`) names any node of a cluster; clients
are then redis-py's cluster clients, which route each command to the node owning its keys' slot (every
multi-key command and transaction of loragate stays inside one hash tag: `loragate.contracts`). They
offer the same commands as a single-node client, which is the type callers see. A blocking reader
(`connect_async_single`) reads one slot's streams on the node that owns it (`node_url`); pub/sub works on
any node (a cluster forwards every `PUBLISH` to all nodes).

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
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

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


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def is_cluster(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://…`)."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def _plain(url: str) -> str:
    """The `redis://` (or `rediss://`) form of a cluster URL, as redis-py's cluster client takes it."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster")))


def node_url(url: str, host: str, port: int) -> str:
    """The plain URL of one cluster node, with the cluster URL's credentials, TLS and options."""
    parts = urlsplit(_plain(url))
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@{host}:{port}" if auth else f"{host}:{port}"))


def retry_once() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), 1)


def async_retry_once() -> AsyncRetry:
    return AsyncRetry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), 1)


def no_retry() -> Retry:
    return Retry(NoBackoff(), 0)  # redis-py's default (`retry=None`) would retry 3 times


class ClusterClient(redis.RedisCluster):
    """redis-py's cluster client whose `close` also closes its node connections.

    Built from a URL, redis-py (8.1) gives each node's client a connection pool that client does not own,
    so `RedisCluster.close` left every node's sockets open until garbage collection (a `ResourceWarning`
    then), and a process that replaces its client kept them."""

    def close(self) -> None:
        nodes = self.get_nodes() if getattr(self, "nodes_manager", None) else []
        super().close()
        for node in nodes:
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()


def connect_sync(url: str | None, socket_timeout: float = 10.0, idempotent: bool = False) -> redis.Redis:
    """A blocking client (the worker's). Its reads are short (`BLOCK` ≤ 100 ms), so a socket timeout bounds
    how long a server that stopped answering (without closing the connection) can hold a thread. It
    retries a failed command only if the caller says that every command it sends may run twice."""
    resolved = resolve(url)
    options: dict[str, Any] = {
        "retry": retry_once() if idempotent else no_retry(),
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 2.0,
    }
    if is_cluster(resolved):
        return cast(redis.Redis, ClusterClient.from_url(_plain(resolved), **options))
    return redis.Redis.from_url(resolved, **options)


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
    if is_cluster(resolved):
        # The cluster client keeps a pool per node that fails (MaxConnectionsError) rather than waits at
        # its bound: it keeps redis-py's default (unbounded; connections are made as concurrency needs).
        cluster = aioredis.RedisCluster.from_url(_plain(resolved), **async_options(resolved))
        return cast(aioredis.Redis, cluster)
    pool = aioredis.BlockingConnectionPool.from_url(
        resolved, max_connections=max_connections, timeout=wait_s, **async_options(resolved)
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() disconnects it


def connect_async_single(url: str) -> aioredis.Redis:
    """A client on one dedicated connection (a blocking reader). It does not retry: its owner must see
    every reconnect, since the connection's `CLIENT ID` (and perhaps the server) changes with it."""
    if is_cluster(url):
        raise ValueError(f"{url}: a single-connection client reads one node: pass `node_url(...)`")
    options = async_options(url) | {"retry": AsyncRetry(NoBackoff(), 0)}
    return aioredis.Redis.from_url(url, single_connection_client=True, **options)


def connect_pubsub(url: str) -> aioredis.Redis:
    """A client for pub/sub. On a cluster, a plain client of the node the URL names: a cluster forwards
    every `PUBLISH` to all its nodes, so a subscriber on any node hears every channel."""
    plain = _plain(url) if is_cluster(url) else url
    return aioredis.Redis.from_url(plain, **async_options(plain))
