"""The worker service: drives the engine step by step and talks only to Redis.

Loop: heartbeat (≈1 s) → cancellations → when idle, a blocking `XREADGROUP` on `lg:q:{worker}` → one
engine step → one pipeline, one round trip, with all of the step's Redis I/O: each request's output
event on `lg:out:{id}`, the `XACK` of requests whose last event that was (never before it), the previous
step's KV events, and a non-blocking read of newly queued requests (only as many as the engine can
start soon, so the rest wait in Redis where they can be re-routed). On start it first re-reads its own
pending entries (a restart), resuming after any tokens that were already streamed. SIGTERM drains: the
heartbeat says `draining`, no new admissions, running requests finish, then the heartbeat is removed so
gateways re-route whatever is still queued.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import redis
from opentelemetry.trace import Tracer
from redis.client import Pipeline

from loragate import keys
from loragate.messages import OutputEvent, QueuedRequest, WorkerState, streamed_so_far
from loragate.types import Request, RequestOutput
from policies.events import EventType, KVEvent
from worker.engine import LLMEngine
from worker.lora import AdapterError
from worker.registry import AdapterRegistry
from worker.tracing_spans import RequestTimeline, emit_spans

log = logging.getLogger("loragate.worker")

HEARTBEAT_S = 1.0
HEARTBEAT_TTL_S = 3
OUTPUT_TTL_S = 600
EVENTS_MAXLEN = 20_000


@dataclass
class _Active:
    entry_id: str
    message: QueuedRequest
    timeline: RequestTimeline | None = None


def already_streamed(r: redis.Redis, request_id: str) -> tuple[list[int], str, bool]:
    """Tokens and text a request's output stream already holds, and whether its last event was written."""
    return streamed_so_far(r.xrange(keys.output(request_id)))


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
    ):
        self.engine, self.redis, self.worker_id, self.model_name = engine, r, worker_id, model_name
        self.tracer = tracer
        self.registry = registry
        self.max_waiting = max_waiting
        self.queue = keys.queue(worker_id)
        self.active: dict[str, _Active] = {}
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self._last_beat = 0.0
        self._tokens_window: list[tuple[float, int]] = []
        self._adapter_tiers: dict[str, str] = {}
        self._deferred_events: list[KVEvent] = []  # the last step's, sent with the next step's outputs
        self._pubsub = r.pubsub(ignore_subscribe_messages=True)

    def _create_group(self) -> None:
        """The queue and its consumer group. Made after the first heartbeat: a gateway's reaper deletes an
        empty queue whose worker has no heartbeat, and must not take ours for a dead worker's."""
        try:
            self.redis.xgroup_create(self.queue, keys.WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        self._pubsub.subscribe(keys.CANCEL)
        self._emit([KVEvent(EventType.CLEARED, ts=time.time())])  # routers forget what we held before
        self.heartbeat(force=True)
        self._create_group()
        self._admit(pending=True)
        while not (self.draining.is_set() and not self.engine.has_unfinished()):
            self.heartbeat()
            self._poll_cancels()
            if not self.engine.has_unfinished():
                self._emit(self._deferred_events)
                self._deferred_events = []
                if not self.draining.is_set():  # idle: wait in Redis for work, then step at once
                    self._admit(pending=False, block_ms=100)
                continue
            self._flush(self.engine.step())
        self._emit(self._deferred_events)
        self.redis.delete(keys.worker_state(self.worker_id))
        self._pubsub.close()
        self.stopped.set()

    def drain(self) -> None:
        self.draining.set()

    # -- admission --------------------------------------------------------------------------------
    def _room(self) -> int:
        return self.max_waiting - len(self.engine.scheduler.waiting)

    def _admit(self, pending: bool, block_ms: int = 0) -> None:
        """Read queued requests: our own pending entries ("0", after a restart) or new ones (">")."""
        if self._room() <= 0:
            return
        block = block_ms if block_ms > 0 and not pending else None  # BLOCK 0 would wait forever
        try:
            reply = self.redis.xreadgroup(
                keys.WORKER_GROUP,
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
        """The queue or its group vanished (deleted by hand, or Redis restarted empty): make them again."""
        if "NOGROUP" not in str(error):
            raise error
        log.warning("queue %s had no consumer group; recreating it", self.queue)
        self._create_group()

    def _start_entries(self, reply: Any, pending: bool) -> None:
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._start(entry_id.decode(), QueuedRequest.from_json(fields[b"m"]), pending)

    def _start(self, entry_id: str, msg: QueuedRequest, pending: bool) -> None:
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
                    timeline.adapter_tier = self.engine.adapters.tier(adapter)
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
        self.active[msg.request_id] = _Active(entry_id, replace(msg, resume_token_ids=resume), timeline)

    def _fail(self, entry_id: str, msg: QueuedRequest, status: int, message: str) -> None:
        kind = "timeout" if status == 504 else "invalid_request_error"
        event = OutputEvent(
            worker_id=self.worker_id, error={"message": message, "type": kind, "code": None, "status": status}
        )
        self.redis.xadd(keys.output(msg.request_id), {"e": event.to_json()})
        self.redis.expire(keys.output(msg.request_id), OUTPUT_TTL_S)
        self._ack(entry_id)

    def _ack(self, entry_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.queue, keys.WORKER_GROUP, entry_id)
        pipe.xdel(self.queue, entry_id)
        pipe.execute()

    # -- outputs ----------------------------------------------------------------------------------
    def _flush(self, outputs: list[RequestOutput]) -> None:
        """All of a step's Redis I/O in one round trip (one pipeline, executed in order): each request's
        output event, then the acks of finished requests (so a request is acknowledged only after its last
        event is written), then the previous step's KV events, then a non-blocking read of newly queued
        requests, which join the batch at the next step."""
        pipe = self.redis.pipeline(transaction=True)  # MULTI: an output refused (e.g. OOM) aborts its ack too
        finished = self._add_outputs(pipe, outputs)
        for rid in finished:
            pipe.xack(self.queue, keys.WORKER_GROUP, self.active[rid].entry_id)
            pipe.xdel(self.queue, self.active[rid].entry_id)
        # A step's KV events go out with the next step's outputs (or when the engine idles), so the
        # first token of a new request does not share its write, and the routers' reads, with them.
        self._add_events(pipe, self._deferred_events)
        self._deferred_events = self._kv_events()
        polling = not self.draining.is_set() and self._room() > 0
        if polling:
            pipe.xreadgroup(
                keys.WORKER_GROUP, self.worker_id, {self.queue: ">"}, count=self._room(), block=None
            )
        replies = pipe.execute(raise_on_error=False)
        for reply in replies[:-1] if polling else replies:
            if isinstance(reply, Exception):
                raise reply
        for rid, reason in finished.items():
            done = self.active.pop(rid)
            if self.tracer is not None and done.timeline is not None:
                emit_spans(self.tracer, done.timeline, self.worker_id, reason)
        self._tokens_window.append((time.monotonic(), sum(len(o.new_token_ids) for o in outputs)))
        if polling:
            if isinstance(replies[-1], redis.ResponseError):
                self._regroup(replies[-1])
            else:
                self._start_entries(replies[-1], pending=False)

    def _add_outputs(self, pipe: Pipeline, outputs: list[RequestOutput]) -> dict[str, str | None]:
        """Queue each output's event on `pipe`; returns the finished requests and their finish reasons."""
        finished: dict[str, str | None] = {}
        for out in outputs:
            active = self.active.get(out.request_id)
            if active is None:
                continue
            event = OutputEvent(
                token_ids=out.new_token_ids,
                text=out.text_delta,
                finish_reason=out.finish_reason.value if out.finish_reason else None,
                prompt_tokens=len(active.message.prompt_token_ids),
                completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
                worker_id=self.worker_id,
            )
            if active.timeline is not None:
                active.timeline.on_tokens(len(out.new_token_ids), out.cached_tokens)
            key = keys.output(out.request_id)
            pipe.xadd(key, {"e": event.to_json()})
            pipe.expire(key, OUTPUT_TTL_S)
            if out.finished:
                finished[out.request_id] = event.finish_reason
        return finished

    def _kv_events(self) -> list[KVEvent]:
        """Prefix-cache and adapter-residency changes of this step, for the routers' precise index."""
        now = time.time()
        stored, evicted = self.engine.blocks.drain_events()
        events = [
            KVEvent(t, hashes=tuple(h), ts=now)
            for t, h in ((EventType.STORED, stored), (EventType.EVICTED, evicted))
            if h
        ]
        rank = {"device": 2, "host": 1, "disk": 0}
        for name, tier in self.engine.adapters.tier_events:
            moved_up = rank[tier] >= rank.get(self._adapter_tiers.get(name, "disk"), 0)
            kind = EventType.ADAPTER_LOADED if moved_up else EventType.ADAPTER_EVICTED
            events.append(KVEvent(kind, adapter=name, tier=tier, ts=now))
            self._adapter_tiers[name] = tier
        self.engine.adapters.tier_events.clear()
        return events

    def _add_events(self, pipe: Pipeline, events: list[KVEvent]) -> None:
        for event in events:
            pipe.xadd(
                keys.events(self.worker_id), {"e": event.to_json()}, maxlen=EVENTS_MAXLEN, approximate=True
            )

    def _emit(self, events: list[KVEvent]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._add_events(pipe, events)
        pipe.execute()

    def _poll_cancels(self) -> None:
        while (msg := self._pubsub.get_message(timeout=0)) is not None:
            rid = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
            if rid in self.active:
                self.engine.abort(rid)

    # -- heartbeat --------------------------------------------------------------------------------
    def state(self) -> WorkerState:
        e = self.engine
        now = time.monotonic()
        self._tokens_window = [(t, n) for t, n in self._tokens_window if now - t < 10.0]
        span = now - self._tokens_window[0][0] if len(self._tokens_window) > 1 else 0.0
        rate = sum(n for _, n in self._tokens_window) / span if span > 0 else 0.0
        return WorkerState(
            worker_id=self.worker_id,
            model=self.model_name,
            model_dir=str(e.model_dir),
            max_model_len=e.max_model_len,
            adapters_device=tuple(e.adapters.device_lru),
            adapters_host=tuple(e.adapters.host),
            pinned=tuple(sorted(self.registry.pinned)),
            kv_blocks_free=e.blocks.num_free_blocks,
            kv_blocks_total=e.blocks.num_blocks,
            block_size=e.config.block_size,
            running=len(e.scheduler.running),
            waiting=len(e.scheduler.waiting),
            max_adapters=e.config.max_loras,
            draining=self.draining.is_set(),
            decode_tok_s=round(rate, 1),
        )

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self.registry.sync(self.engine)
            self.redis.set(keys.worker_state(self.worker_id), self.state().to_json(), ex=HEARTBEAT_TTL_S)
