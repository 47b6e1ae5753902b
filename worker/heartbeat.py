"""The worker's heartbeat, on a thread of its own, so a long engine step never makes the worker look dead.

The engine loop publishes a `WorkerState` snapshot between steps (`publish`); this thread writes the
latest one to `lg:w:{worker}` every `interval_s` with a TTL, on its own Redis connection, and records
the base model in the fleet's memory of models (`lg:models`, so gateways answer 503 rather than 404 for
a known model while none of its workers is live). A step that takes longer than the TTL (a big prefill on
a loaded CPU) no longer lets the heartbeat lapse. A wedged engine must not look alive forever, though:
once the newest snapshot is older than `stale_after_s` the thread stops beating and the worker's key
expires, so gateways re-route its queue. When Redis is unreachable the thread retries with backoff and
jitter, so the worker re-announces itself as soon as Redis is back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import redis

from loragate import contracts
from loragate.messages import WorkerState
from loragate.redis_retry import OUTAGE_ERRORS, Backoff, OutageLog
from worker.device import dtype_name
from worker.engine import LLMEngine

log = logging.getLogger("loragate.worker")

STALE_AFTER_S = 60.0  # no snapshot from the engine loop for this long: a wedged engine, stop beating


class Heartbeat:
    def __init__(
        self,
        r: redis.Redis,
        worker_id: str,
        model: str,
        interval_s: float = contracts.HEARTBEAT_S,
        ttl_s: float = contracts.HEARTBEAT_TTL_S,
        stale_after_s: float = STALE_AFTER_S,
    ):
        self.redis, self.worker_id = r, worker_id
        self.key = contracts.worker_state(model, worker_id)
        self.interval_s, self.ttl_s, self.stale_after_s = interval_s, ttl_s, stale_after_s
        self.beats = 0
        self._state: WorkerState | None = None
        self._published = 0.0  # monotonic time of the latest snapshot
        self._lock = threading.Lock()  # one beat at a time (the thread, or the engine loop's `beat`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outage = OutageLog(log, f"heartbeat of {worker_id}")

    def publish(self, state: WorkerState) -> None:
        """The engine loop's latest state (an atomic reference swap: no lock needed to hand it over)."""
        self._state, self._published = state, time.monotonic()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.worker_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def remove(self) -> None:
        """Stop beating and delete the heartbeat (gateways re-route what is still queued)."""
        self.stop()
        try:
            self.redis.delete(self.key)
        except OUTAGE_ERRORS as e:  # it expires by itself within the TTL
            log.warning("could not remove the heartbeat of %s: %r", self.worker_id, e)

    def beat(self) -> bool:
        """Write the latest snapshot now; False if there is none yet or it is stale. Raises on an outage."""
        with self._lock:
            state = self._state
            if state is None or time.monotonic() - self._published > self.stale_after_s:
                return False
            now = time.time()
            seen = json.dumps(
                {
                    "model_dir": state.model_dir,
                    "max_model_len": state.max_model_len,
                    "block_size": state.block_size,
                    "at": now,
                }
            )
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(
                self.key,
                dataclasses.replace(state, updated_at=now).to_json(),
                px=int(self.ttl_s * 1000),
            )
            pipe.hset(contracts.MODELS, state.model, seen)
            pipe.execute()
            self.beats += 1
            return True

    def _run(self) -> None:
        backoff = Backoff()
        delay, withheld = 0.0, False
        while not self._stop.wait(delay):
            try:
                beat = self.beat()
                if not beat and self._state is not None and not withheld:
                    log.error("engine loop silent for over %.0f s: heartbeat withheld", self.stale_after_s)
                withheld = not beat
                self._outage.recovered()
                backoff.reset()
                delay = self.interval_s
            except OUTAGE_ERRORS as e:
                self._outage.failed(e)
                delay = backoff.next()
            except Exception:  # never let the thread die: a worker without heartbeat gets reaped
                log.exception("heartbeat failed")
                delay = backoff.next()


class DecodeRate:
    """Tokens generated per second over the last `window_s` (for the heartbeat's `decode_tok_s`)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._steps: list[tuple[float, int]] = []

    def add(self, tokens: int) -> None:
        self._steps.append((time.monotonic(), tokens))

    def per_s(self) -> float:
        now = time.monotonic()
        self._steps = [(t, n) for t, n in self._steps if now - t < self.window_s]
        span = now - self._steps[0][0] if len(self._steps) > 1 else 0.0
        return sum(n for _, n in self._steps) / span if span > 0 else 0.0


def engine_state(
    engine: LLMEngine,
    worker_id: str,
    model: str,
    pinned: set[str],
    draining: bool,
    decode_tok_s: float,
) -> WorkerState:
    """The heartbeat's content: what the engine serves and how loaded it is (read on the engine's thread)."""
    info, snap = engine.info, engine.snapshot()
    return WorkerState(
        worker_id=worker_id,
        model=model,
        model_dir=str(info.model_dir),
        max_model_len=info.max_model_len,
        adapters_device=snap.adapters_device,
        adapters_host=snap.adapters_host,
        pinned=tuple(sorted(pinned)),
        kv_blocks_free=snap.kv_blocks_free,
        kv_blocks_total=snap.kv_blocks_total,
        block_size=info.block_size,
        running=snap.running,
        waiting=snap.waiting,
        max_adapters=info.max_loras,
        max_running=info.max_num_seqs,
        draining=draining,
        decode_tok_s=round(decode_tok_s, 1),
        device=info.device,
        dtype=dtype_name(info.dtype),
    )
