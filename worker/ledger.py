"""The requests a worker holds, and every output event it produced for them, until Redis surely has them.

A request is `active` from the moment the worker reads its queue entry until its last event and its ack
are written, then `recent` for `RECENT_S` more: a Redis that restarts from an append-only file written
once a second (or from nothing) may lose the last events of a request that had already finished here.

After Redis comes back the worker repairs what it lost, in this order (`WorkerService._resync`):

1. `reclaim`: running requests whose queue entry is no longer pending on this worker. If Redis lost the
   entry (it restarted, or the consumer group is new), it is queued again, already read by this worker
   (one transaction, which also points the request's record `lg:req:{id}` at the new entry), so a reaper
   could still re-route it should this worker die later, and a client's retry attaches to it. If not, a
   gateway's reaper re-routed it while this worker was out of reach: the worker drops its copy, since the
   new owner continues from the output stream and two writers would interleave.
2. `repair`: the events each output stream lacks. Every event carries the request's cumulative
   `completion_tokens`, so the stream's last event says how far it got and only later events are written
   again: a stream that lost its tail, or all of it, ends up complete and never repeats; a gateway that
   had relayed some of the re-written events drops them by the same count
   (`gateway.relay.EventChannel`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from loragate import contracts, request_record
from loragate.messages import OutputEvent, QueuedRequest
from loragate.types import RequestOutput
from worker.tracing_spans import RequestTimeline

log = logging.getLogger("loragate.worker")

RECENT_S = 30.0  # a finished request's events are kept this long, for a Redis that restarts and loses them


@dataclass
class Held:
    entry_id: str
    message: QueuedRequest
    timeline: RequestTimeline | None = None
    events: list[OutputEvent] = field(default_factory=list)  # all this worker produced for it, in order
    done_at: float = 0.0  # monotonic time its last event and ack were confirmed written

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].is_last


class Ledger:
    def __init__(self, r: redis.Redis, worker_id: str, model: str):
        self.redis, self.worker_id, self.model = r, worker_id, model
        self.queue = contracts.queue(model, worker_id)
        self.active: dict[str, Held] = {}
        self.recent: dict[str, Held] = {}

    def held(self, request_id: str, entry_id: str) -> Held | None:
        """The request, if this very queue entry is already ours (re-read after a reconnect)."""
        known = self.active.get(request_id) or self.recent.get(request_id)
        return known if known is not None and known.entry_id == entry_id else None

    def hold(self, held: Held) -> None:
        self.recent.pop(held.message.request_id, None)  # a new entry for a finished id: continued
        self.active[held.message.request_id] = held

    def record(self, out: RequestOutput) -> OutputEvent | None:
        """The event for one step's output of a held request (None: not ours any more), kept."""
        held = self.active.get(out.request_id)
        if held is None:
            return None
        event = OutputEvent(
            token_ids=out.new_token_ids,
            text=out.text_delta,
            finish_reason=out.finish_reason.value if out.finish_reason else None,
            prompt_tokens=len(held.message.prompt_token_ids),
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            worker_id=self.worker_id,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )
        if held.timeline is not None:
            held.timeline.on_tokens(len(out.new_token_ids), out.cached_tokens)
        held.events.append(event)
        return event

    def retire(self, request_id: str) -> Held:
        """Its last event and ack are written."""
        done = self.active.pop(request_id)
        done.done_at = time.monotonic()
        self.recent[request_id] = done
        return done

    def prune(self) -> None:
        now = time.monotonic()
        self.recent = {k: h for k, h in self.recent.items() if now - h.done_at < RECENT_S}

    # -- after an outage ----------------------------------------------------------------------------
    def reclaim(self, lost: bool) -> tuple[list[str], list[tuple[str, QueuedRequest]]]:
        """Step 1 (see the module's docstring). Returns the running requests to drop (re-routed
        elsewhere), and the other new queue entries that re-queueing ours read (start them)."""
        entries = {rid: h.entry_id for rid, h in self.active.items()}
        owned = owned_entries(self.redis, self.queue, self.worker_id, entries) if entries else set()
        gone = [rid for rid in self.active if rid not in owned]
        finished = [rid for rid in gone if self.active[rid].finished]
        running = [rid for rid in gone if not self.active[rid].finished]
        if not lost:  # finished ones were acknowledged (by us, or by a reaper that took them over)
            for rid in finished:
                self.retire(rid)
            for rid in running:
                log.warning("request %s was re-routed while Redis was out of reach: dropping it", rid)
                self.active.pop(rid)
            return running, []
        if not running:
            return [], []
        ids, others = restore_entries(
            self.redis, self.queue, self.worker_id, [self.active[rid].message for rid in running]
        )
        for rid, entry_id in ids.items():
            self.active[rid].entry_id = entry_id
        log.warning("queued %d running requests again that Redis had lost", len(ids))
        # A restart that lost only the read (not the entry) leaves the old entry unread: that read took it
        # too. It is a second copy of a request running here (starting it would fail "id in use"): drop it.
        copies = [entry_id for entry_id, msg in others if msg.request_id in self.active]
        if copies:
            pipe = self.redis.pipeline(transaction=False)
            for entry_id in copies:
                pipe.xack(self.queue, contracts.WORKER_GROUP, entry_id)
                pipe.xdel(self.queue, entry_id)
            pipe.execute()
            log.warning("dropped %d old queue entries of requests queued again", len(copies))
        return [], [(entry_id, msg) for entry_id, msg in others if msg.request_id not in self.active]

    def repair(self, restarted: bool) -> int:
        """Step 2: write what the output streams lack; returns how many events that was."""
        requests = {**self.active, **(self.recent if restarted else {})}
        lasts = last_events(self.redis, self.model, list(requests))
        writes = [
            (rid, event)
            for (rid, held), last in zip(requests.items(), lasts, strict=True)
            for event in missing_events(last, held.events)
        ]
        if writes:
            pipe = self.redis.pipeline(transaction=False)
            for rid, event in writes:
                pipe.xadd(contracts.output(self.model, rid), {contracts.OUTPUT_FIELD: event.to_json()})
                pipe.expire(contracts.output(self.model, rid), contracts.OUTPUT_TTL_S)
            pipe.execute()
            log.warning("wrote again %d output events that had not reached Redis", len(writes))
        return len(writes)

    def acknowledge_finished(self, restarted: bool) -> list[Held]:
        """Acknowledge requests whose last event is written (again: a restart may have undone acks);
        returns the ones that were still active (now retired)."""
        done = [h for h in self.active.values() if h.finished]
        acks = [*done, *(self.recent.values() if restarted else ())]
        if acks:
            pipe = self.redis.pipeline(transaction=False)
            for h in acks:
                pipe.xack(self.queue, contracts.WORKER_GROUP, h.entry_id)
                pipe.xdel(self.queue, h.entry_id)
            pipe.execute()
        return [self.retire(h.message.request_id) for h in done]


def missing_events(last: OutputEvent | None, events: list[OutputEvent]) -> list[OutputEvent]:
    """The suffix of `events` (this worker's, in order) that a stream whose last event is `last` lacks."""
    if last is not None and last.is_last:
        return []  # the stream ended: nothing of ours may follow
    seen = last.completion_tokens if last is not None else 0
    # An event without tokens is a final one (an abort); it is missing since the stream has not ended.
    return [e for e in events if e.completion_tokens > seen or not e.token_ids]


def last_events(r: redis.Redis, model: str, request_ids: list[str]) -> list[OutputEvent | None]:
    """The last event of each request's output stream (None: empty or gone), in one round trip."""
    if not request_ids:
        return []
    pipe = r.pipeline(transaction=False)
    for rid in request_ids:
        pipe.xrevrange(contracts.output(model, rid), count=1)
    return [
        OutputEvent.from_json(got[0][1][contracts.OUTPUT_FIELD_BYTES]) if got else None
        for got in pipe.execute()
    ]


def owned_entries(r: redis.Redis, queue: str, consumer: str, entries: Mapping[str, str]) -> set[str]:
    """Which of `entries` (request id → queue entry id) are pending on `consumer`, in one round trip."""
    pipe = r.pipeline(transaction=False)
    for entry_id in entries.values():
        pipe.xpending_range(queue, contracts.WORKER_GROUP, entry_id, entry_id, 1, consumername=consumer)
    replies = pipe.execute(raise_on_error=False)
    return {rid for rid, reply in zip(entries, replies, strict=True) if isinstance(reply, list) and reply}


def restore_entries(
    r: redis.Redis, queue: str, consumer: str, messages: Iterable[QueuedRequest]
) -> tuple[dict[str, str], list[tuple[str, QueuedRequest]]]:
    """Queue `messages` again and read them as `consumer` in one transaction, so no other reader can take
    them; each request's record names its new entry, so a client's retry attaches to it rather than
    queueing a copy. Returns their new entry ids, and every other new entry that this read took (queued by
    gateways meanwhile: the caller starts those)."""
    pipe = r.pipeline(transaction=True)
    messages = list(messages)
    for msg in messages:
        pipe.eval(
            request_record.REQUEUE,
            2,
            queue,
            contracts.request_record(msg.model, msg.request_id),
            msg.to_json(),
        )
    pipe.xreadgroup(contracts.WORKER_GROUP, consumer, {queue: ">"})
    *added, reply = pipe.execute()
    ours = {_text(a): m.request_id for a, m in zip(added, messages, strict=True)}
    ids = {rid: entry_id for entry_id, rid in ours.items()}
    others = [(entry_id, msg) for entry_id, msg in read_entries(reply) if entry_id not in ours]
    return ids, others


def read_entries(reply: Any) -> list[tuple[str, QueuedRequest]]:
    """An `XREADGROUP` reply as (entry id, message) pairs; entries deleted meanwhile are skipped."""
    out = []
    streams = reply.items() if isinstance(reply, dict) else reply or []
    for _, entries in streams:
        for raw_id, fields in stream_entries(entries):
            out.append((_text(raw_id), QueuedRequest.from_json(fields[contracts.QUEUE_FIELD_BYTES])))
    return out


def stream_entries(entries: Any) -> list[tuple[Any, dict[bytes, bytes]]]:
    """A stream's entries (`XRANGE`, one stream of `XREADGROUP`) as (id, fields) pairs, without those
    deleted meanwhile. redis-py's cluster transactions hand replies back unparsed (a flat field list
    per entry; `XREADGROUP` as a dict): both forms are read here."""
    out = []
    for raw_id, fields in entries or []:
        if isinstance(fields, list):
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        if fields:
            out.append((raw_id, fields))
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
