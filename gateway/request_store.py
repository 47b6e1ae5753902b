"""A request's identity and record in Redis: who owns an id, enqueue once, cancel, continue.

Ids are scoped to tenants: the id a client sends (`X-Request-Id`) or is given names, inside loragate,
the request `contracts.scoped_request_id(tenant, id)`, which every Redis key, cancel message and the worker
use. Two tenants that send the same id get two independent requests; no key can read, attach to or
cancel another tenant's request, whatever id it sends.

Every queued request has a record `lg:req:{model}:id` (a fingerprint of what was asked, and where its queue
entry is) written with its queue entry by one script, only if the request is not live already (its
output stream or its queue entry exists): a retry that arrives while its first try is still queued
attaches to it instead of queueing a second copy (which would fail with "request id already in use" or
interleave two generations). Two more scripts change a request atomically, so any number of gateways
and handlers may race on it:

A request may also wait on its model's shared stream (`enqueue_shared`: no worker could take it yet), from
which a worker moves it onto its own queue, pointing the record at the new entry
(`loragate.request_record.MOVE`).

- `cancel`: a queue entry that no worker has read yet is deleted, and the `abort` event written in the
  worker's stead (the request never runs); a request a worker holds is cancelled over pub/sub (`abort`).
- `revive`: a request whose output stream ends with an `abort` event (a client that left cut it short)
  is continued: the abort event is deleted and the request queued again; the worker resumes after the
  tokens the stream already holds. Only the first of several handlers that saw the same abort event
  requeues it; the others go on reading.

The scripts find the queue entry through the record (a key they were not passed): on Redis Cluster that
queue is in the same slot, since every key of a request's path carries its base model's hash tag
(`contracts.slot_tag`); a request never moves to another model's queue.
"""

from __future__ import annotations

import hashlib
import json

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from gateway.errors import APIError
from loragate import contracts
from loragate.contracts import RECORD_ENTRY as ENTRY
from loragate.contracts import RECORD_FP as FP
from loragate.contracts import RECORD_QUEUE as QUEUE
from loragate.messages import OutputEvent, QueuedRequest, shallow_dict

# A request is live while its output stream exists (it runs or ran; kept a while after its end) or its
# queue entry does (queued, or held by a worker: a worker deletes the entry when the request ends). A
# record whose request is neither (its output expired, or it was lost) may be made anew.
_LIVE = f"""
local function live(record, output)
    if redis.call('EXISTS', output) == 1 then
        return true
    end
    local queue = redis.call('HGET', record, '{QUEUE}')
    local entry = redis.call('HGET', record, '{ENTRY}')
    return queue ~= false and entry ~= false and #redis.call('XRANGE', queue, entry, entry) > 0
end
"""

_LOOKUP = (
    _LIVE
    + f"""
if not live(KEYS[1], KEYS[2]) then
    return false
end
return redis.call('HGET', KEYS[1], '{FP}') or ''
"""
)

# queue(record, queue, message, fp, ttl): queue the message, the record naming it; returns the entry id.
_QUEUE = f"""
local function queue(record, stream, message, fp, ttl)
    local entry = redis.call('XADD', stream, '*', '{contracts.QUEUE_FIELD}', message)
    redis.call('HSET', record, '{FP}', fp, '{QUEUE}', stream, '{ENTRY}', entry)
    redis.call('EXPIRE', record, ttl)
    return entry
end
"""

_ENQUEUE = (
    _LIVE
    + _QUEUE
    + """
if live(KEYS[1], KEYS[2]) then
    return false
end
return queue(KEYS[1], KEYS[3], ARGV[1], ARGV[2], ARGV[3])
"""
)

# The same on a model's shared stream (KEYS[3]), bounded: -1 when it holds ARGV[4] entries already. Its
# consumer group (ARGV[5]) is made with it, so `cancel` finds an entry that no worker took unread.
_ENQUEUE_SHARED = (
    _LIVE
    + _QUEUE
    + """
if live(KEYS[1], KEYS[2]) then
    return false
end
if redis.call('XLEN', KEYS[3]) >= tonumber(ARGV[4]) then
    return -1
end
pcall(redis.call, 'XGROUP', 'CREATE', KEYS[3], ARGV[5], '0', 'MKSTREAM')
return queue(KEYS[1], KEYS[3], ARGV[1], ARGV[2], ARGV[3])
"""
)
SHARED_FULL = -1  # `enqueue_shared`'s reply when the model's shared stream is at its bound

_CANCEL = f"""
local queue = redis.call('HGET', KEYS[1], '{QUEUE}')
local entry = redis.call('HGET', KEYS[1], '{ENTRY}')
if queue and entry then
    local ok, pending = pcall(redis.call, 'XPENDING', queue, ARGV[4], entry, entry, 1)
    if ok and #pending == 0 and redis.call('XDEL', queue, entry) == 1 then
        redis.call('XADD', KEYS[2], '*', '{contracts.OUTPUT_FIELD}', ARGV[2])
        redis.call('EXPIRE', KEYS[2], ARGV[3])
        return 1
    end
end
redis.call('PUBLISH', ARGV[5], ARGV[1])
return 0
"""

_REVIVE = (
    _QUEUE
    + """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last == 0 or last[1][1] ~= ARGV[1] then
    return false
end
redis.call('XDEL', KEYS[2], ARGV[1])
return queue(KEYS[1], KEYS[3], ARGV[2], ARGV[3], ARGV[4])
"""
)

ABORTED = OutputEvent(finish_reason="abort").to_json()  # what the worker would have written


def fingerprint(msg: QueuedRequest) -> str:
    """What was asked (model, adapter, prompt, sampling): a retry must ask the same."""
    what = [msg.model, msg.adapter, msg.operation, msg.prompt_token_ids, shallow_dict(msg.params)]
    return hashlib.sha256(json.dumps(what, separators=(",", ":")).encode()).hexdigest()[:32]


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class RequestStore:
    def __init__(self, r: aioredis.Redis, ttl_s: int, model: str):
        self.redis, self.ttl_s = r, ttl_s  # ttl_s: a record's lifetime (the request's deadline and more)
        self.model = model  # the base model: its keys' hash tag

    def _keys(self, request_id: str) -> tuple[str, str]:
        return contracts.request_record(self.model, request_id), contracts.output(self.model, request_id)

    async def exists(self, request_id: str, fp: str) -> bool:
        """Whether the request is live (queued, running, or its output still kept): a retry attaches to
        it. 409 when it was made, with this id, for something else."""
        known = _text(await self.redis.eval(_LOOKUP, 2, *self._keys(request_id)))
        if known is None:
            return False
        if known and known != fp:
            raise APIError(
                409,
                "This X-Request-Id was already used for a different request; a retry must send the same "
                "request, a new request a new id.",
                param="X-Request-Id",
                code="request_id_conflict",
            )
        return True

    def enqueue(self, pipe: Pipeline, msg: QueuedRequest, fp: str, worker_id: str) -> None:
        """Queue `msg` on `pipe` unless the request exists already; the pipeline's reply for this command
        is the queue entry id, or None when the request was there first (attach to it)."""
        rid = msg.request_id
        keys_ = (*self._keys(rid), contracts.queue(self.model, worker_id))
        pipe.eval(_ENQUEUE, 3, *keys_, msg.to_json(), fp, self.ttl_s)

    def enqueue_shared(self, pipe: Pipeline, msg: QueuedRequest, fp: str, bound: int) -> None:
        """As `enqueue`, on `msg.model`'s shared stream (`contracts.model_queue`), where the first worker
        of that model with room takes it; the reply is `SHARED_FULL` when the stream holds `bound`
        entries already."""
        rid = msg.request_id
        keys_ = (*self._keys(rid), contracts.model_queue(self.model))
        pipe.eval(_ENQUEUE_SHARED, 3, *keys_, msg.to_json(), fp, self.ttl_s, bound, contracts.WORKER_GROUP)

    async def cancel(self, request_id: str) -> bool:
        """Cancel the request: dropped from its queue if no worker has read it yet (True), else
        cancelled on its worker."""
        dropped = await self.redis.eval(
            _CANCEL,
            2,
            *self._keys(request_id),
            request_id,
            ABORTED,
            contracts.OUTPUT_TTL_S,
            contracts.WORKER_GROUP,
            contracts.CANCEL,
        )
        return bool(dropped)

    async def revive(self, abort_entry: str, msg: QueuedRequest, fp: str, worker_id: str) -> str | None:
        """Queue `msg` again on `worker_id` if the request's output stream still ends with the abort event
        `abort_entry`; returns the new queue entry id, or None when another handler did it already."""
        rid = msg.request_id
        entry = await self.redis.eval(
            _REVIVE,
            3,
            *self._keys(rid),
            contracts.queue(self.model, worker_id),
            abort_entry,
            msg.to_json(),
            fp,
            self.ttl_s,
        )
        return _text(entry)
