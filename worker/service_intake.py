"""The worker's intake: its queue stream `lg:q:{worker}`, read as consumer `{worker}` of the workers' group.

Requests are read with `XREADGROUP` — new ones (">") only as many as the engine can start soon, so the
rest wait in Redis where gateways can re-route them; this worker's own pending ones ("0") at every re-sync
— and each is started in the engine, continuing right after whatever its output stream already holds (a
previous worker, or this one before an outage, may have streamed part of it), or failed to its client
with an error event (deadline passed, bad adapter, a request the engine refuses). A guided request whose
guide is not compiled yet is held like the others but reaches the engine only once its grammar compiled on
the compile threads (`worker.service_compiles`, picked up by `start_compiled` on the step thread): it counts
against the room for new reads meanwhile, a re-read of its entry finds it held, and a cancel or a re-sync
that drops it forgets it (`cancel`, `discard`). An entry is acknowledged and deleted only after its
request's last event is written. A queue or group that vanished (deleted by hand, or a Redis that restarted
empty) is made again. What was held across an outage is the ledger's
(`worker.ledger`); the step's own reads and acks ride in the service's pipeline (`add_read`, `add_acks`).

Work stealing: requests for this worker's model that no worker could take when they came wait on the
model's shared stream `lg:mq:{model}` (`contracts.model_queue`). Whenever this worker has room left after
reading its own queue, it moves the oldest of them onto its own queue (`request_record.MOVE`: atomic, and
a no-op for an entry another worker moved first), where the next read takes them as if they had been
routed here: a worker that just started (scale from zero or up) gets load at once, and a request never
waits on the shared stream while some worker of its model has room. A draining worker takes none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import redis
from redis.client import Pipeline

from loragate import contracts, request_record
from loragate.messages import OutputEvent, QueuedRequest
from loragate.types import Request, RequestOutput
from worker.engine import LLMEngine
from worker.engine_requests import unstarted_abort
from worker.ledger import Held, Ledger, read_entries, stream_entries
from worker.lora import AdapterError
from worker.registry import AdapterRegistry
from worker.service_compiles import CompileFn, GrammarCompiles
from worker.service_outputs import add_event, already_streamed
from worker.tracing_spans import RequestTimeline

log = logging.getLogger("loragate.worker")


class Intake:
    def __init__(
        self,
        r: redis.Redis,
        worker_id: str,
        engine: LLMEngine,
        registry: AdapterRegistry,
        ledger: Ledger,
        max_waiting: int,
        traced: bool,
        compile_fn: CompileFn | None = None,
        steal: bool = True,
    ):
        self.redis, self.worker_id, self.model = r, worker_id, ledger.model
        self.queue = contracts.queue(self.model, worker_id)
        # The model's shared stream this worker steals from (None: only its own queue).
        self.shared = contracts.model_queue(self.model) if steal else None
        self.stolen = 0  # entries moved here from the shared stream
        self.engine, self.registry, self.ledger = engine, registry, ledger
        self.max_waiting = max_waiting
        self.traced = traced  # keep a timeline of each request, for its spans
        # `compile_fn`: how a guide compiles (on the pool): the engine's thread-safe compile by default.
        self.compiles = GrammarCompiles(compile_fn or engine.grammar.compile, name=f"compile-{worker_id}")
        self.aborted: list[RequestOutput] = []  # final outputs of requests cancelled while compiling

    def create_group(self) -> bool:
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

    def room(self) -> int:
        """How many new requests to read: no more than `max_waiting` unstarted ones, in the engine's queue
        or still compiling their guides."""
        return self.max_waiting - self.engine.num_waiting - len(self.compiles)

    def has_work(self) -> bool:
        """True while a guide compiles or a cancelled one's final output is not yet taken."""
        return bool(self.compiles) or bool(self.aborted)

    # -- reading ----------------------------------------------------------------------------------
    def admit(self, pending: bool, block_ms: int = 0) -> None:
        """Read queued requests: our own pending entries ("0", at every re-sync) or new ones (">", only as
        many as there is room for). Pending ones are read whatever the room (the engine queues them): an
        entry pending here but not held — read by a command whose reply was lost — has no other reader, and
        a reaper never takes it from a live worker."""
        if not pending and self.room() <= 0:
            return
        block = block_ms if block_ms > 0 and not pending else None  # BLOCK 0 would wait forever
        try:
            reply = self.redis.xreadgroup(
                contracts.WORKER_GROUP,
                self.worker_id,
                {self.queue: "0" if pending else ">"},
                count=None if pending else self.room(),
                block=block,
            )
        except redis.ResponseError as e:
            self._regroup(e)
            return
        self._start_entries(reply, pending=pending)

    def add_read(self, pipe: Pipeline) -> bool:
        """A non-blocking read of new entries as the last command of `pipe`, if there is room (True);
        its reply goes to `take_read`."""
        if self.room() <= 0:
            return False
        pipe.xreadgroup(
            contracts.WORKER_GROUP, self.worker_id, {self.queue: ">"}, count=self.room(), block=None
        )
        return True

    def add_peek(self, pipe: Pipeline) -> bool:
        """The oldest entries of the model's shared stream, as many as there is room for, on `pipe` (True
        if added); its reply goes to `steal` once the step's own read is started."""
        if self.shared is None or self.room() <= 0:
            return False
        pipe.xrange(self.shared, count=self.room())
        return True

    def steal(self, peeked: Any = None) -> int:
        """Move shared-stream entries (`peeked`, an `XRANGE` reply, or read now) onto this worker's own
        queue, no more than its room; returns how many moved. The next read starts them."""
        if self.shared is None or (room := self.room()) <= 0:
            return 0
        if peeked is None:
            peeked = self.redis.xrange(self.shared, count=room)
        if not peeked or isinstance(peeked, Exception):
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for raw_id, fields in stream_entries(peeked[:room]):
            raw = fields.get(contracts.QUEUE_FIELD_BYTES)
            if raw is None:
                continue
            rid = QueuedRequest.from_json(raw).request_id
            keys = (self.shared, self.queue, contracts.request_record(self.model, rid))
            pipe.eval(request_record.MOVE, 3, *keys, raw_id, raw, contracts.WORKER_GROUP)
        moved = sum(1 for entry in pipe.execute() if entry)
        self.stolen += moved
        return moved

    def take_read(self, reply: Any) -> None:
        """Start what an `add_read` read (its reply may be the error of a queue that vanished)."""
        if isinstance(reply, redis.ResponseError):
            self._regroup(reply)
        else:
            self._start_entries(reply, pending=False)

    def _regroup(self, error: redis.ResponseError) -> None:
        """The queue or its group vanished (deleted by hand, or Redis restarted empty): make them again.
        Redis 7 ends a blocked read of a deleted stream with "UNBLOCKED ... no longer exists"."""
        if "NOGROUP" not in str(error) and "UNBLOCKED" not in str(error):
            raise error
        log.warning("queue %s had no consumer group; recreating it", self.queue)
        self.create_group()

    def _start_entries(self, reply: Any, pending: bool) -> None:
        for entry_id, msg in read_entries(reply):
            self.start(entry_id, msg, pending)

    # -- starting ---------------------------------------------------------------------------------
    def start(self, entry_id: str, msg: QueuedRequest, pending: bool) -> None:
        """Start one queued request in the engine, held in the ledger (or fail it to its client), unless
        it is already ours or already finished."""
        held = self.ledger.held(msg.request_id, entry_id)
        if held is not None:  # re-read after a reconnect: already ours
            if held.finished:  # only its ack was lost (with a restarted Redis)
                self.ack(entry_id)
            return
        streamed: list[int] = []
        text = ""
        done = False
        if pending or msg.attempt > 0:  # only then can output already exist
            streamed, text, done = already_streamed(self.redis, self.model, msg.request_id)
        if done:  # finished before a crash, only the ack was lost
            self.ack(entry_id)
            return
        # The output stream is the truth about what the client already has: continue right after it.
        resumed = replace(msg, resume_token_ids=tuple(streamed))
        if streamed:
            log.info(
                "resuming %s after %d streamed tokens (attempt %d)",
                msg.request_id,
                len(streamed),
                msg.attempt,
            )
        started = time.perf_counter()
        try:
            timeline, request = self._request(msg, resumed.resume_token_ids, text)
            if request.request_id in self.compiles:  # as the engine refuses an id it runs
                raise ValueError(f"request id {request.request_id!r} is already in use")
            if request.params.guide and not self.engine.grammar.is_compiled(request.params):
                self.engine.check_request(request)  # fail now what fails without its guide
                self.compiles.submit(request)  # added by `start_compiled`
            else:
                self.engine.add_request(request)
        except (ValueError, AdapterError, TimeoutError) as e:
            self._fail(entry_id, msg, 504 if isinstance(e, TimeoutError) else 400, str(e))
            return
        if timeline is not None and timeline.adapter_tier in ("host", "disk"):
            timeline.adapter_load_s = time.perf_counter() - started
        self.ledger.hold(Held(entry_id, resumed, timeline))

    def start_compiled(self) -> None:
        """Add to the engine the requests whose guides have compiled (on the step thread), or fail those
        whose guides did not to their clients (400, as if the engine had refused them)."""
        for c in self.compiles.finished():
            rid = c.request.request_id
            try:
                self.engine.add_request(c.request, c.future.result())
            except (ValueError, AdapterError) as e:
                held = self.ledger.active[rid]
                self._fail(held.entry_id, held.message, 400, str(e))  # if Redis fails here: done again
                del self.ledger.active[rid]
            self.compiles.forget(rid)

    def cancel(self, request_id: str) -> bool:
        """Abort a request whose guide is compiling (False if it is not): it never starts, and its final
        output, as the engine's for an abort, comes from `take_aborted`."""
        c = self.compiles.compiling.get(request_id)
        if c is None:
            return False
        self.compiles.forget(request_id)
        self.aborted.append(unstarted_abort(c.request))
        return True

    def discard(self, request_id: str) -> bool:
        """Forget a request whose guide is compiling, with no output (a re-sync found it re-routed)."""
        return self.compiles.forget(request_id)

    def take_aborted(self) -> list[RequestOutput]:
        outputs, self.aborted = self.aborted, []
        return outputs

    def close(self) -> None:
        self.compiles.close()

    def _request(
        self, msg: QueuedRequest, resume: tuple[int, ...], text: str
    ) -> tuple[RequestTimeline | None, Request]:
        """The engine's request for `msg` (raising why it cannot run), its adapter registered; its timeline
        if traced."""
        timeline = RequestTimeline(msg) if self.traced else None
        if msg.deadline and time.time() > msg.deadline:
            raise TimeoutError("the request's deadline passed while it was queued")
        adapter = None
        if msg.adapter is not None:
            adapter = self.registry.ensure_registered(self.engine, msg.adapter)
            if timeline is not None:
                timeline.adapter_tier = self.engine.adapter_tier(adapter)
        request = Request(
            msg.request_id,
            msg.prompt_token_ids,
            msg.params,
            adapter,
            resume_token_ids=resume,
            resume_text=text,
        )
        return timeline, request

    def _fail(self, entry_id: str, msg: QueuedRequest, status: int, message: str) -> None:
        kind = "timeout" if status == 504 else "invalid_request_error"
        event = OutputEvent(
            worker_id=self.worker_id, error={"message": message, "type": kind, "code": None, "status": status}
        )
        add_event(self.redis, self.model, msg.request_id, event)
        self.ack(entry_id)

    # -- acknowledging ----------------------------------------------------------------------------
    def ack(self, entry_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self.add_acks(pipe, [entry_id])
        pipe.execute()

    def add_acks(self, pipe: Pipeline, entry_ids: Iterable[str]) -> None:
        """Acknowledge and delete entries whose requests' last events are written (earlier in `pipe`)."""
        for entry_id in entry_ids:
            pipe.xack(self.queue, contracts.WORKER_GROUP, entry_id)
            pipe.xdel(self.queue, entry_id)
