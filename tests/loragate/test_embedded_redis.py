"""The embedded Redis persists its data (append-only file, fsync every second): a server killed outright
and started again on the same directory has its streams back; and it never outlives its parent."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import redis

from loragate import contracts
from loragate.embedded_redis import EmbeddedRedis


def test_a_killed_server_restarts_with_its_queue(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        ids = [client.xadd(contracts.queue("tiny", "w1"), {"n": str(i)}) for i in range(100)]
        client.close()
        time.sleep(1.5)  # past one fsync: what a crash may lose is at most the last second
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)  # no shutdown, no final fsync
        server.proc.wait(timeout=10)
        assert not server.running()
        server.start()
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        assert [entry_id for entry_id, _ in client.xrange(contracts.queue("tiny", "w1"))] == ids
        client.close()
    finally:
        server.stop()
    assert not server.running()


def test_a_long_directory_still_gets_a_working_socket(tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*["d" * 20] * 6)  # a unix socket path holds ~108 bytes at most
    server = EmbeddedRedis(deep)
    server.start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        assert client.ping()
        client.close()
        assert (deep / "appendonly.aof").exists()
    finally:
        server.stop()
    assert not server.socket_path.parent.exists()
