"""The worker service: drives the engine step by step and talks only to Redis.

Loop: cancellations → when idle, a blocking `XREADGROUP` on `lg:q:{worker}` → one engine step → one
pipeline, one round trip, with all of the step's Redis I/O: each request's output event on
`lg:out:{id}`, the `XACK` of requests whose last event that was (never before it), the previous step's KV
events, and a non-blocking read of newly queued requests (only as many as the engine can start soon, so
the rest wait in Redis where they can be re-routed). The heartbeat has a thread of its own
(`worker.heartbeat`), fed a state snapshot by this loop, so a long step never makes the worker look dead.
SIGTERM drains: the heartbeat says `draining`, no new admissions, running requests finish, then the
heartbeat is removed so gateways re-route whatever is still queued. A drain while Redis is down stops the
worker at once: what runs cannot be delivered anyway, and the gateways re-route it from its queue.

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
from dataclasses import replace
from typing import Any

import redis
from opentelemetry.trace import Tracer
from redis.client import PubSub

from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest, WorkerState, streamed_so_far
from loragate.redis_retry import OUTAGE_ERRORS, Backoff, OutageLog, ServerGuard, server_run_id
from loragate.types import Request, RequestOutput
from worker.engine import LLMEngine
from worker.heartbeat import DecodeRate, Heartbeat, engine_state
from worker.kv_events import KVEventLog
from worker.ledger import Held, Ledger, read_entries
from worker.lora import AdapterError
from worker.registry import AdapterRegistry
from worker.tracing_spans import RequestTimeline, emit_spans

log = logging.getLogger("loragate.worker")

REGISTRY_SYNC_S = 1.0
SNAPSHOT_S = 0.2  # how often the engine loop hands the heartbeat a fresh state


def already_streamed(r: redis.Redis, request_id: str) -> tuple[list[int], str, bool]:
    """Tokens and text a request's output stream already holds, and whether its last event was written."""
    return streamed_so_far(r.xrange(contracts.output(request_id)))


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
    ):
        self.engine, self.redis, self.worker_id, self.model_name = engine, r, worker_id, model_name
        # No command of this loop may reach a restarted Redis before `_resync` has repaired it.
        self.guard = ServerGuard()
        self.guard.install(r)
        self.tracer = tracer
        self.registry = registry
        self.max_waiting = max_waiting
        self.queue = contracts.queue(worker_id)
        self.ledger = Ledger(r, worker_id)
        self.heartbeat = heartbeat or Heartbeat(r, worker_id)
        self.kv_events = KVEventLog(worker_id)
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self.run_id: str | None = None  # the Redis server (process) this worker last synced with
        self.outages = 0  # outages ridden out
        self._last_sync = self._last_snapshot = 0.0
        self._decode_rate = DecodeRate()
        self._pubsub: PubSub | None = None

    @property
    def active(self) -> dict[str, Held]:
        return self.ledger.active

    def _create_group(self) -> bool:
        """The queue and its consumer group (True if the group was missing). Made after the heartbeat: a
        gateway's reaper deletes an empty queue whose worker has no heartbeat, and must not take ours for a
        dead worker's."""
        try:
            self.redis.xgroup_create(self.queue, contracts.WORKER_GROUP, id="0", mkstream=True)
            return True
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
            return False

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        self._publish_state()
        self.heartbeat.start()
        backoff, outage = Backoff(), OutageLog(log, f"worker {self.worker_id}")
        try:
            while True:
                try:
                    self._resync()
                    backoff.reset()
                    if outage.recovered() is not None:
                        self.outages += 1
                    self._serve()
                    break
                except OUTAGE_ERRORS as e:  # pause stepping: the ledger keeps whatever was not written
                    outage.failed(e)
                    if self.draining.is_set():
                        self._abandon()
                        break
                    self._publish_state()  # alive, only waiting: the heartbeat goes out once Redis is back
                    self.draining.wait(backoff.next())  # a drain ends the wait at once
            with contextlib.suppress(*OUTAGE_ERRORS):  # KV events only steer routing
                self.kv_events.emit(self.redis, self.kv_events.deferred)
        finally:
            self.heartbeat.remove()
            if self._pubsub is not None:
                with contextlib.suppress(*OUTAGE_ERRORS):
                    self._pubsub.close()
            self.stopped.set()

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
        while not (self.draining.is_set() and not self.engine.has_work()):
            self._tick()
            self._poll_cancels()
            if not self.engine.has_work():
                self.kv_events.emit(self.redis, self.kv_events.deferred)
                self.kv_events.deferred = []
                if not self.draining.is_set():  # idle: wait in Redis for work, then step at once
                    self._admit(pending=False, block_ms=100)
                continue
            self._flush(self.engine.step())

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_sync >= REGISTRY_SYNC_S:
            self._last_sync = now
            self.registry.sync(self.engine)
            self.ledger.prune()
        if now - self._last_snapshot >= SNAPSHOT_S:
            self._publish_state()

    def drain(self) -> None:
        self.draining.set()

    def _resync(self) -> None:
        """Announce this worker and repair what Redis lost (`worker.ledger`): at start, after outages."""
        self.guard.open()
        run_id = server_run_id(self.redis.info("server"))
        restarted = run_id != self.run_id  # a new Redis process (or our first contact with one)
        self.registry.republish()
        self.registry.sync(self.engine)
        self._publish_state()
        self.heartbeat.beat()
        lost_group = self._create_group()
        if self._pubsub is not None:
            with contextlib.suppress(*OUTAGE_ERRORS):
                self._pubsub.close()
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(contracts.CANCEL)
        dropped, others = self.ledger.reclaim(lost=restarted or lost_group)
        for rid in dropped:
            self.engine.abort(rid)  # its abort output is no longer ours: the ledger ignores it
        for entry_id, msg in others:
            self._start(entry_id, msg, pending=False)
        self.ledger.repair(restarted)
        for done in self.ledger.acknowledge_finished(restarted):
            self._spans(done)
        self._admit(pending=True)
        self.kv_events.emit(self.redis, self.kv_events.snapshot(self.engine))
        if server_run_id(self.redis.info("server")) != run_id:  # restarted again meanwhile: once more
            raise redis.ConnectionError("Redis restarted during the re-sync")
        self.guard.accept(run_id)
        self.run_id = run_id

    # -- admission --------------------------------------------------------------------------------
    def _room(self) -> int:
        return self.max_waiting - self.engine.num_waiting

    def _admit(self, pending: bool, block_ms: int = 0) -> None:
        """Read queued requests: our own pending entries ("0", at every re-sync) or new ones (">", only as
        many as there is room for). Pending ones are read whatever the room (the engine queues them): an
        entry pending here but not held — read by a command whose reply was lost — has no other reader, and
        a reaper never takes it from a live worker."""
        if not pending and self._room() <= 0:
            return
        block = block_ms if block_ms > 0 and not pending else None  # BLOCK 0 would wait forever
        try:
            reply = self.redis.xreadgroup(
                contracts.WORKER_GROUP,
                self.worker_id,
                {self.queue: "0" if pending else ">"},
                count=None if pending else self._room(),
                block=block,
            )
        except redis.ResponseError as e:
            self._regroup(e)
            return
        self._start_entries(reply, pending)

    def _regroup(self, error: redis.ResponseError) -> None:
        """The queue or its group vanished (deleted by hand, or Redis restarted empty): make them again.
        Redis 7 ends a blocked read of a deleted stream with "UNBLOCKED ... no longer exists"."""
        if "NOGROUP" not in str(error) and "UNBLOCKED" not in str(error):
            raise error
        log.warning("queue %s had no consumer group; recreating it", self.queue)
        self._create_group()

    def _start_entries(self, reply: Any, pending: bool) -> None:
        for entry_id, msg in read_entries(reply):
            self._start(entry_id, msg, pending)

    def _start(self, entry_id: str, msg: QueuedRequest, pending: bool) -> None:
        held = self.ledger.held(msg.request_id, entry_id)
        if held is not None:  # re-read after a reconnect: already ours
            if held.finished:  # only its ack was lost (with a restarted Redis)
                self._ack(entry_id)
            return
        streamed: list[int] = []
        text = ""
        done = False
        if pending or msg.attempt > 0:  # only then can output already exist
            streamed, text, done = already_streamed(self.redis, msg.request_id)
        if done:  # finished before a crash, only the ack was lost
            self._ack(entry_id)
            return
        # The output stream is the truth about what the client already has: continue right after it.
        resume = tuple(streamed)
        timeline = RequestTimeline(msg) if self.tracer is not None else None
        started = time.perf_counter()
        try:
            if msg.deadline and time.time() > msg.deadline:
                raise TimeoutError("the request's deadline passed while it was queued")
            adapter = None
            if msg.adapter is not None:
                adapter = self.registry.ensure_registered(self.engine, msg.adapter)
                if timeline is not None:
                    timeline.adapter_tier = self.engine.adapter_tier(adapter)
            self.engine.add_request(
                Request(
                    msg.request_id,
                    msg.prompt_token_ids,
                    msg.params,
                    adapter,
                    resume_token_ids=resume,
                    resume_text=text,
                )
            )
        except (ValueError, AdapterError, TimeoutError) as e:
            status = 504 if isinstance(e, TimeoutError) else 400
            self._fail(entry_id, msg, status, str(e))
            return
        if timeline is not None and timeline.adapter_tier in ("host", "disk"):
            timeline.adapter_load_s = time.perf_counter() - started
        self.ledger.hold(Held(entry_id, replace(msg, resume_token_ids=resume), timeline))

    def _fail(self, entry_id: str, msg: QueuedRequest, status: int, message: str) -> None:
        kind = "timeout" if status == 504 else "invalid_request_error"
        event = OutputEvent(
            worker_id=self.worker_id, error={"message": message, "type": kind, "code": None, "status": status}
        )
        self.redis.xadd(contracts.output(msg.request_id), {contracts.OUTPUT_FIELD: event.to_json()})
        self.redis.expire(contracts.output(msg.request_id), contracts.OUTPUT_TTL_S)
        self._ack(entry_id)

    def _ack(self, entry_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.queue, contracts.WORKER_GROUP, entry_id)
        pipe.xdel(self.queue, entry_id)
        pipe.execute()

    # -- outputs ----------------------------------------------------------------------------------
    def _flush(self, outputs: list[RequestOutput]) -> None:
        """All of a step's Redis I/O in one round trip (one pipeline, executed in order): each request's
        output event, then the acks of finished requests (so a request is acknowledged only after its last
        event is written), then the previous step's KV events, then a non-blocking read of newly queued
        requests, which join the batch at the next step."""
        pipe = self.redis.pipeline(transaction=True)  # MULTI: an output refused (e.g. OOM) aborts its ack too
        # Recorded before the write: if Redis fails now, `_resync` writes whatever did not arrive.
        finished = []
        for out in outputs:
            if (event := self.ledger.record(out)) is not None:
                pipe.xadd(contracts.output(out.request_id), {contracts.OUTPUT_FIELD: event.to_json()})
                pipe.expire(contracts.output(out.request_id), contracts.OUTPUT_TTL_S)
                if event.is_last:
                    finished.append(out.request_id)
        for rid in finished:
            pipe.xack(self.queue, contracts.WORKER_GROUP, self.active[rid].entry_id)
            pipe.xdel(self.queue, self.active[rid].entry_id)
        # A step's KV events go out with the next step's outputs (or when the engine idles), so the
        # first token of a new request does not share its write, and the routers' reads, with them.
        self.kv_events.add(pipe, self.kv_events.deferred)
        self.kv_events.deferred = self.engine.drain_events()
        polling = not self.draining.is_set() and self._room() > 0
        if polling:
            pipe.xreadgroup(
                contracts.WORKER_GROUP, self.worker_id, {self.queue: ">"}, count=self._room(), block=None
            )
        replies = pipe.execute(raise_on_error=False)
        for reply in replies[:-1] if polling else replies:
            if isinstance(reply, Exception):
                raise reply
        for rid in finished:
            self._spans(self.ledger.retire(rid))
        self._decode_rate.add(sum(len(o.new_token_ids) for o in outputs))
        if polling:
            if isinstance(replies[-1], redis.ResponseError):
                self._regroup(replies[-1])
            else:
                self._start_entries(replies[-1], pending=False)

    def _spans(self, done: Held) -> None:
        if self.tracer is not None and done.timeline is not None:
            emit_spans(self.tracer, done.timeline, self.worker_id, done.events[-1].finish_reason)

    def _poll_cancels(self) -> None:
        assert self._pubsub is not None  # subscribed by `_resync`
        while (msg := self._pubsub.get_message(timeout=0)) is not None:
            rid = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
            if rid in self.active:
                self.engine.abort(rid)

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
