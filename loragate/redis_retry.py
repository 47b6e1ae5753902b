"""Riding out a Redis outage: which errors mean "Redis is unreachable", backoff with jitter, and quiet logs.

Every long-lived loop (the worker's engine loop and heartbeat, the gateway's fleet view, output relay,
reaper, KV-event follower, policy listener) treats an outage the same way: log once, retry with
exponential backoff and jitter, log once more when Redis answers again, then re-announce or re-read what
the server may have lost. The grace below is the contract between them: after Redis returns, every live
process gets `RESYNC_GRACE_S` to re-announce itself (heartbeat, queue group, running requests) before a
gateway reaps a queue whose worker has no heartbeat or declares a waiting request lost.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis

BACKOFF_BASE_S = 0.05  # first retry after an error
BACKOFF_CAP_S = 2.0  # the longest wait between two retries: a returning Redis is noticed this fast
# Workers retry at least every BACKOFF_CAP_S and re-announce within a few round trips; the rest is margin.
RESYNC_GRACE_S = 3 * BACKOFF_CAP_S

# What an unreachable, restarting (LOADING: `BusyLoadingError`) or unanswering server raises; redis-py
# wraps socket errors in its own ConnectionError. Nothing broader: a file error must not pass for an outage.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)


def is_outage(error: BaseException) -> bool:
    return isinstance(error, OUTAGE_ERRORS)


class Backoff:
    """Exponential backoff with "equal jitter": the n-th wait is uniform in [d/2, d], d = min(cap, base·2ⁿ).
    The jitter spreads the reconnects of a whole fleet; the lower half keeps every wait near its bound."""

    def __init__(
        self,
        base_s: float = BACKOFF_BASE_S,
        cap_s: float = BACKOFF_CAP_S,
        rng: Callable[[], float] = random.random,
    ):
        self.base_s, self.cap_s, self._rng = base_s, cap_s, rng
        self.attempts = 0

    def next(self) -> float:
        bound = min(self.cap_s, self.base_s * 2**self.attempts)
        self.attempts = min(self.attempts + 1, 32)  # 2**32 · base is far past any cap
        return bound / 2 + self._rng() * bound / 2

    def reset(self) -> None:
        self.attempts = 0


class OutageLog:
    """One warning when a loop loses Redis and one line when it is back, not one traceback per retry."""

    def __init__(self, log: logging.Logger, what: str):
        self.log, self.what = log, what
        self.down_since: float | None = None

    def failed(self, error: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.log.warning("%s: Redis unreachable (%r); retrying with backoff", self.what, error)

    def recovered(self) -> float | None:
        """Call after a success: the outage's length in seconds if one just ended, else None."""
        if self.down_since is None:
            return None
        took = time.monotonic() - self.down_since
        self.down_since = None
        self.log.warning("%s: Redis reachable again after %.1f s", self.what, took)
        return took


def server_run_id(info: dict[str, Any]) -> str:
    """From `INFO server`: the id that changes whenever the Redis server process restarts (of a cluster's
    nodes, as a cluster client returns it: node -> its section, the ids of all of them)."""
    if "run_id" in info or not info:
        return str(info.get("run_id", ""))
    return ",".join(sorted(str(v.get("run_id", "")) for v in info.values() if isinstance(v, dict)))


def server_info(r: redis.Redis, key: str) -> dict[str, Any]:
    """`INFO server` of the server that holds `key` (on a cluster, the node owning its slot)."""
    if isinstance(r, redis.RedisCluster):
        return dict(r.info("server", target_nodes=r.get_node_from_key(key)))
    return dict(r.info("server"))


async def fleet_server_info(r: aioredis.Redis) -> dict[str, Any]:
    """`INFO server` of the server, or of all a cluster's nodes merged: every run id, the least uptime."""
    if not isinstance(r, aioredis.RedisCluster):
        return dict(await r.info("server"))
    infos = await r.info("server", target_nodes=aioredis.RedisCluster.ALL_NODES)
    sections = [v for v in infos.values() if isinstance(v, dict)] or [infos]
    return {
        "run_id": server_run_id(infos),
        "uptime_in_seconds": min(float(s.get("uptime_in_seconds", 0)) for s in sections),
    }


class ServerGuard:
    """Lets a client's connections reach only the Redis server process its owner last synced with.

    redis-py reconnects pooled connections silently, so after a Redis restart the next command would run on
    the new server as if nothing had happened: a worker would append output events to streams that lost
    their beginning, and serve a queue whose group and running entries are gone. With the guard installed,
    a connection to another server process fails with `ConnectionError` (the outage path) until the owner
    has re-synced and `accept`s the new server; `open` lets every server through (during that re-sync).
    """

    def __init__(self) -> None:
        self.expected: str | None = None

    def install(self, r: redis.Redis, key: str) -> None:
        """Guard every connection `r` makes from now on (its current ones are closed) to the server that
        holds `key` (on a cluster: the node owning its slot, whose run id `server_info` reads)."""
        if isinstance(r, redis.RedisCluster):
            node = r.get_node_from_key(key)
            pool = node.redis_connection.connection_pool
        else:
            pool = r.connection_pool
        pool.disconnect()
        pool.connection_kwargs["redis_connect_func"] = self._on_connect
        pool.reset()

    def open(self) -> None:
        self.expected = None

    def accept(self, run_id: str) -> None:
        self.expected = run_id

    def _on_connect(self, conn: Any) -> None:
        conn.on_connect()
        if self.expected is None:
            return
        conn.send_command("INFO", "server")
        raw = conn.read_response()
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        run_id = next((line[7:].strip() for line in text.splitlines() if line.startswith("run_id:")), "")
        if run_id != self.expected:
            raise redis.ConnectionError(f"Redis restarted (run_id {run_id[:8]}): re-sync before using it")
