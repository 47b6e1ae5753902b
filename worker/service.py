"""The worker service: drives the engine step by step and talks only to Redis.

Loop: cancellations (`worker.service_cancels`) → when idle, a blocking read of the queue (`worker.
service_intake`) → one engine step → the step's writes handed to a thread of their own (`worker.
service_writes`: one pipeline with each request's output event on `lg:out:{id}`, `worker.
service_outputs`, the `XACK` of requests whose last event that was, never before it, and the previous
step's KV events, `worker.kv_events`), sent while the engine computes the next step where that leaves a
core to the sending (on a GPU, or a CPU engine on fewer threads than cores) → a non-blocking read
of newly queued requests, when the engine has room (only as many as it can start soon, so the rest wait
in Redis where they can be re-routed). The heartbeat has a thread of its own (`worker.heartbeat`), fed a
state snapshot by this loop, so a long step never makes the worker look dead. SIGTERM drains: the
heartbeat says `draining`, no new admissions, running requests finish (and those whose guides still
compile, `worker.service_compiles`, start and finish), then the heartbeat is removed so gateways re-route
whatever is still queued. A drain while Redis is down stops the worker at once: what
runs cannot be delivered anyway, and the gateways re-route it from its queue.

Redis may vanish at any moment, for any length of time. Every event is kept in memory until its request
has finished and been acknowledged (and `RECENT_S` longer), so what Redis loses can be written again.
When a command fails for want of Redis, stepping pauses (running sequences keep their KV cache), the
loop retries with backoff and jitter, and on reconnect `_resync` — the same path a fresh start takes —
re-announces the worker (adapters, heartbeat, consumer group, cancel subscription, prefix-cache contents)
and repairs what the server lost (see `worker.ledger`): queue entries of running requests, and the
missing tail of each output stream, never more, so a client's stream neither repeats nor skips. Until
then a guard (`loragate.redis_retry.ServerGuard`) keeps every command off a Redis that restarted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis
from opentelemetry.trace import Tracer
from redis.client import Pipeline

from loragate import contracts
from loragate.messages import WorkerState
from loragate.redis_retry import OUTAGE_ERRORS, Backoff, OutageLog, ServerGuard, server_info, server_run_id
from loragate.types import RequestOutput
from worker.engine import LLMEngine
from worker.heartbeat import DecodeRate, Heartbeat, engine_state
from worker.kv_events import KVEventLog
from worker.ledger import Held, Ledger
from worker.registry import AdapterRegistry
from worker.service_cancels import CancelFeed
from worker.service_compiles import CompileFn
from worker.service_intake import Intake
from worker.service_outputs import OutputWriter
from worker.service_writes import StepWrite, StepWriter, overlap_by_default, raise_write_errors

log = logging.getLogger("loragate.worker")

REGISTRY_SYNC_S = 1.0
SNAPSHOT_S = 0.2  # how often the engine loop hands the heartbeat a fresh state
COMPILE_WAIT_S = 0.05  # an idle loop waiting for a guide to compile looks at cancels and the queue this often
WARM_JOIN_SECONDS = 60.0  # a stop waits at most this long for the structured-output engine to finish loading


class WorkerService:
    def __init__(
        self,
        engine: LLMEngine,
        r: redis.Redis,
        worker_id: str,
        model_name: str,
        registry: AdapterRegistry,
        max_waiting: int = 8,
        tracer: Tracer | None = None,
        heartbeat: Heartbeat | None = None,
        compile_fn: CompileFn | None = None,
        overlap_writes: bool | None = None,
    ):
        self.engine, self.redis, self.worker_id, self.model_name = engine, r, worker_id, model_name
        # No command of this loop may reach a restarted Redis before `_resync` has repaired it.
        self.guard = ServerGuard()
        self.guard.install(r, contracts.queue(model_name, worker_id))
        self.registry = registry
        self.ledger = Ledger(r, worker_id, model_name)
        # `compile_fn`: how guides compile on the intake's threads (tests slow it down); the engine's.
        self.intake = Intake(
            r,
            worker_id,
            engine,
            registry,
            self.ledger,
            max_waiting,
            tracer is not None,
            compile_fn,
        )
        self.outputs = OutputWriter(self.ledger, worker_id, tracer)
        self.kv_events = KVEventLog(model_name, worker_id)
        if overlap_writes is None:
            overlap_writes = overlap_by_default(engine.config.device)
        self.writes = StepWriter(r, model_name, self.intake.add_acks, self.kv_events.add, overlap_writes)
        self.cancels = CancelFeed(r)
        self.heartbeat = heartbeat or Heartbeat(r, worker_id, model_name)
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self.run_id: str | None = None  # the Redis server (process) this worker last synced with
        self.outages = 0  # outages ridden out
        self._last_sync = self._last_snapshot = 0.0
        self._decode_rate = DecodeRate()

    @property
    def active(self) -> dict[str, Held]:
        return self.ledger.active

    def drain(self) -> None:
        self.draining.set()

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        self._publish_state()
        # Off the step thread: loading it on the first guided request would stall every running one.
        warming = threading.Thread(target=self._warm_grammar, daemon=True, name=f"grammar-{self.worker_id}")
        warming.start()
        self.heartbeat.start()
        try:
            self._serve_through_outages()
            with contextlib.suppress(*OUTAGE_ERRORS):  # KV events only steer routing
                self.kv_events.emit(self.redis, self.kv_events.deferred)
        finally:
            self.writes.close()
            self.heartbeat.remove()
            self.cancels.close()
            self.intake.close()
            # A worker stopped as it starts must not exit while the load is still in xgrammar's native
            # code: at interpreter exit that daemon thread is unwound inside C++ and the process aborts.
            warming.join(WARM_JOIN_SECONDS)
            if warming.is_alive():
                log.warning("worker %s: exiting while the grammar engine still loads", self.worker_id)
            self.stopped.set()

    def _warm_grammar(self) -> None:
        try:
            self.engine.warm_grammar()
        except Exception:  # a guided request will meet (and report) the same error
            log.exception("worker %s: could not load the structured-output engine", self.worker_id)

    def _serve_through_outages(self) -> None:
        backoff, outage = Backoff(), OutageLog(log, f"worker {self.worker_id}")
        while True:
            try:
                self._resync()
                backoff.reset()
                if outage.recovered() is not None:
                    self.outages += 1
                self._serve()
                return
            except OUTAGE_ERRORS as e:  # pause stepping: the ledger keeps whatever was not written
                with contextlib.suppress(*OUTAGE_ERRORS):  # a write in flight: wait for it, it may have gone
                    self._settle()
                outage.failed(e)
                if self.draining.is_set():
                    self._abandon()
                    return
                self._publish_state()  # alive, only waiting: the heartbeat goes out once Redis is back
                self.draining.wait(backoff.next())  # a drain ends the wait at once

    def _abandon(self) -> None:
        """Draining while Redis is down: stop now rather than wait for it. Nothing running here can be
        delivered without Redis; the queue entries stay pending on this worker, and once its heartbeat has
        lapsed a gateway's reaper re-routes them, to continue from what their output streams hold."""
        running = sorted(self.active)
        log.warning(
            "worker %s: draining while Redis is unreachable; stopping now and leaving %d running requests "
            "to be re-routed by a gateway once this worker's heartbeat lapses: %s",
            self.worker_id,
            len(running),
            ", ".join(running[:20]) + (" ..." if len(running) > 20 else ""),
        )

    def _serve(self) -> None:
        while not (self.draining.is_set() and not self._has_work()):
            self._tick()
            self._poll_cancels()
            self.intake.start_compiled()
            if not self.engine.has_work() and not self.intake.aborted:
                self._settle()  # the last step's write, before the loop waits for work
                self.kv_events.emit(self.redis, self.kv_events.deferred)
                self.kv_events.deferred = []
                if not self.intake.compiles:
                    if not self.draining.is_set():  # idle: wait in Redis for work, then step at once
                        stole = self.intake.steal()
                        self.intake.admit(pending=False, block_ms=0 if stole else 100)
                    continue
                # Only guides compiling: read what is queued without waiting, then wait for a compile.
                if not self.draining.is_set():
                    self.intake.admit(pending=False)
                if not self.engine.has_work():
                    self.intake.compiles.ready.wait(COMPILE_WAIT_S)
                continue
            self._flush(self.engine.step() + self.intake.take_aborted())
        self._settle()

    def _has_work(self) -> bool:
        """Requests running, or held but not yet in the engine (their guides compiling): a drain waits."""
        return self.engine.has_work() or self.intake.has_work()

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_sync >= REGISTRY_SYNC_S:
            self._last_sync = now
            self.registry.sync(self.engine)
            self.ledger.prune()
        if now - self._last_snapshot >= SNAPSHOT_S:
            self._publish_state()

    def _poll_cancels(self) -> None:
        for rid in self.cancels.requested():
            if rid in self.active and not self.intake.cancel(rid):  # not compiling: in the engine
                self.engine.abort(rid)

    # -- re-sync: at start, after outages ---------------------------------------------------------
    def _resync(self) -> None:
        """Announce this worker and repair what Redis lost (`worker.ledger`)."""
        self.guard.open()
        run_id = server_run_id(server_info(self.redis, self.intake.queue))
        restarted = run_id != self.run_id  # a new Redis process (or our first contact with one)
        lost_group = self._announce()
        self._repair(lost=restarted or lost_group, restarted=restarted)
        self.kv_events.emit(self.redis, self.kv_events.snapshot(self.engine))
        if server_run_id(server_info(self.redis, self.intake.queue)) != run_id:  # restarted meanwhile: again
            raise redis.ConnectionError("Redis restarted during the re-sync")
        self.guard.accept(run_id)
        self.run_id = run_id

    def _announce(self) -> bool:
        """Adapters, state and heartbeat, queue group (True if it was missing), cancel subscription."""
        self.registry.republish()
        self.registry.sync(self.engine)
        self._publish_state()
        self.heartbeat.beat()
        lost_group = self.intake.create_group()
        self.cancels.subscribe()
        return lost_group

    def _repair(self, lost: bool, restarted: bool) -> None:
        """The ledger's repairs, in order, then our pending entries that no request holds yet."""
        dropped, others = self.ledger.reclaim(lost=lost)
        for rid in dropped:
            if not self.intake.discard(rid):  # compiling: forgotten, never started
                self.engine.abort(rid)  # its abort output is no longer ours: the ledger ignores it
        for entry_id, msg in others:
            self.intake.start(entry_id, msg, pending=False)
        self.ledger.repair(restarted)
        for done in self.ledger.acknowledge_finished(restarted):
            self.outputs.spans(done)
        self.intake.admit(pending=True)

    # -- a step's I/O -----------------------------------------------------------------------------
    def _flush(self, outputs: list[RequestOutput]) -> None:
        """A step's Redis I/O: its output events are recorded, then written with the acks of finished
        requests (after their last events) and the previous step's KV events, in one MULTI pipeline; then,
        if the engine has room, a non-blocking read of newly queued requests, which join the batch at the
        next step. With a writer thread (`worker.service_writes`) the write goes out while the next step
        computes, once the previous step's has gone through; without, write and read share a round trip."""
        write = StepWrite()
        # Recorded before the write: if Redis fails, `_resync` writes whatever did not arrive.
        self.outputs.record(write, outputs)
        write.acks = [self.active[rid].entry_id for rid in write.finished]
        # A step's KV events go out with the next step's outputs (or when the engine idles), so the
        # first token of a new request does not share its write, and the routers' reads, with them.
        write.kv, self.kv_events.deferred = self.kv_events.deferred, self.engine.drain_events()
        if not self.writes.overlap:  # one round trip for the write and the read
            self._read(self.redis.pipeline(transaction=True), write)  # MULTI: a refused event aborts its ack
            return
        self._settle()
        if write:
            self.writes.submit(write)
        self._read(self.redis.pipeline(transaction=False))

    def _settle(self) -> None:
        """Wait for the step write in flight, if any (raises its error); once written, its finished
        requests retire."""
        if (done := self.writes.settle()) is not None:
            self._written(done)

    def _written(self, write: StepWrite) -> None:
        self.outputs.delivered(write.finished)
        self._decode_rate.add(write.tokens)

    def _read(self, pipe: Pipeline, write: StepWrite | None = None) -> None:
        """A read of newly queued requests, as many as there is room for (this worker's own queue, then
        the model's shared stream, whose entries are moved onto our queue and started by the next read),
        on `pipe`, after `write` if one is given (its errors raise; once written, it retires)."""
        writes = self.writes.add(pipe, write) if write is not None else 0
        reading = not self.draining.is_set()
        peeking = reading and self.intake.add_peek(pipe)
        polling = reading and self.intake.add_read(pipe)
        if not (writes or peeking or polling):
            return
        replies = pipe.execute(raise_on_error=False)
        raise_write_errors(replies[:writes])  # a read's error is handled below
        if write is not None:
            self._written(write)
        if polling:
            self.intake.take_read(replies[-1])
        if peeking:
            self.intake.steal(replies[writes])

    # -- state, for the heartbeat -----------------------------------------------------------------
    def state(self) -> WorkerState:
        return engine_state(
            self.engine,
            self.worker_id,
            self.model_name,
            pinned=self.registry.pinned,
            draining=self.draining.is_set(),
            decode_tok_s=self._decode_rate.per_s(),
        )

    def _publish_state(self) -> None:
        self._last_snapshot = time.monotonic()
        self.heartbeat.publish(self.state())
