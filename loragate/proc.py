"""Process lifecycle shared by every loragate process: which signals mean "stop", and children that
never outlive their parent.

Stop signals are SIGINT (Ctrl-C), SIGTERM (`kill`, service managers, Docker) and SIGHUP (the terminal
went away). Each process installs its own handlers for all three explicitly: a process started with
SIGINT ignored (a shell's background job, some service managers) inherits SIG_IGN, and Python then
never installs its KeyboardInterrupt handler, so Ctrl-C semantics cannot be relied on.

`spawn` starts a child that the kernel signals when its parent dies (Linux `PR_SET_PDEATHSIG`), so even
a SIGKILLed `loragate up`, which gets no chance to clean up, leaves no process behind. The death signal
fires when the *thread* that forked the child exits, so spawn from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

Handler = Callable[[int, FrameType | None], Any]


def install_stop_handler(handler: Handler) -> dict[int, Any]:
    """Route every stop signal to `handler` (also SIGINT when it was inherited as ignored); returns the
    previous handlers, for `restore_handlers`. Main thread only, like `signal.signal`."""
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def restore_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def exit_on_stop_signal() -> dict[int, Any]:
    """Until a process has something to drain (still importing, loading a model), a stop signal ends it
    at once: SystemExit unwinds normally (`finally` blocks run), without a traceback. Returns the previous
    handlers, for `restore_handlers`."""

    def stop_now(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    return install_stop_handler(stop_now)


class StopRequests:
    """Counts stop signals for a supervisor loop that polls `count`: the first asks for a graceful stop,
    a second for an immediate one. The handler only counts, so a signal never interrupts clean-up half
    way (raising from a handler, as KeyboardInterrupt does, would)."""

    def __init__(self) -> None:
        self.count = 0
        self.last: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        self._previous = install_stop_handler(self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        restore_handlers(self._previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.last = signum


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_prctl = _load_prctl()  # resolved here, so the forked child only calls it (no imports, no locks)


def die_with_parent(death_signal: int) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `death_signal` to the child when this process dies, or
    None where the platform has no PR_SET_PDEATHSIG."""
    if _prctl is None:
        return None
    prctl, parent = _prctl, os.getpid()

    def arm() -> None:  # runs in the child between fork and exec; the setting survives exec
        prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        # The parent may have died before the line above armed the signal; nothing would ever send it.
        if os.getppid() != parent:
            os._exit(1)

    return arm


def spawn(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    death_signal: int = signal.SIGKILL,
    **popen: Any,
) -> subprocess.Popen[bytes]:
    """Start `args` in a session of its own (a terminal's Ctrl-C reaches only the supervisor, which stops
    its children in order), killed by `death_signal` if this process dies first."""
    return subprocess.Popen(
        list(args), env=env, start_new_session=True, preexec_fn=die_with_parent(death_signal), **popen
    )
