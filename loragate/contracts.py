"""Every cross-process contract, in one place (see docs/DESIGN.md): Redis key names and patterns, stream
field names, TTLs, the KV/adapter event types on `lg:events:{model}:worker`, and the adapter tiers.

Torch-free and dependency-free: the gateway, the policies, the worker and the load tools all import it,
and no other module spells a key, a stream field or an event type itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

PREFIX = "lg"
# Redis Cluster: the keys that one script or transaction touches share a hash tag (the `{...}` part of the
# name: Redis Cluster hashes only that), so they live in one slot. The unit is a base model: its workers'
# queues, heartbeats and KV-event streams, its shared queue, its requests' records and output streams —
# everything a request's path touches atomically, since a request only ever moves between workers of its
# model. Models spread over the cluster's shards; policy keys share the tag `{policy}`.
POLICY_TAG = "{policy}"
WORKER_GROUP = "workers"  # consumer group on every queue stream
ADAPTERS = f"{PREFIX}:adapters"  # hash: "{base}:{name}" -> AdapterRecord JSON
API_KEYS = f"{PREFIX}:keys"  # hash: sha256(api key) -> tenant name
POLICY = f"{PREFIX}:{POLICY_TAG}"  # hash: version -> {"version", "document", "created_at"} JSON
POLICY_ACTIVE = f"{PREFIX}:{POLICY_TAG}:active"  # the active version number
POLICY_SEQ = f"{PREFIX}:{POLICY_TAG}:seq"  # version counter
POLICY_SHADOW = f"{PREFIX}:{POLICY_TAG}:shadow"  # a candidate policy document evaluated beside the active one
POLICY_CHANGED = f"{PREFIX}:policy:changed"  # pub/sub: a new active or shadow policy
# The policy keys before they had a hash tag (loragate before Redis Cluster): a gateway copies what it finds
# there to the new keys once (`gateway.policy_store.PolicyStore.migrate`).
LEGACY_POLICY_KEYS = {
    f"{PREFIX}:policy": POLICY,
    f"{PREFIX}:policy:active": POLICY_ACTIVE,
    f"{PREFIX}:policy:seq": POLICY_SEQ,
    f"{PREFIX}:policy:shadow": POLICY_SHADOW,
}
CANCEL = f"{PREFIX}:cancel"  # pub/sub: request ids whose client went away

# Stream entry fields: every stream entry holds one JSON document in one field.
QUEUE_FIELD = "m"  # lg:q:{model}:worker: a `QueuedRequest`
OUTPUT_FIELD = "e"  # lg:out:{model}:request: an `OutputEvent`
EVENTS_FIELD = "e"  # lg:events:{model}:worker: a `KVEvent`
# ... as redis-py returns them (bytes, unless decode_responses).
QUEUE_FIELD_BYTES, OUTPUT_FIELD_BYTES = QUEUE_FIELD.encode(), OUTPUT_FIELD.encode()
EVENTS_FIELD_BYTES = EVENTS_FIELD.encode()


def slot_tag(model: str) -> str:
    """The hash tag of a base model's keys. A name with a brace in it would end the tag early (or start
    another): such names are refused where a worker announces its model (`check_model_name`)."""
    return "{" + model + "}"


def check_model_name(model: str) -> str:
    """A base model name usable in keys: non-empty, no braces (they delimit the hash tag)."""
    if not model or "{" in model or "}" in model:
        raise ValueError(f"model name {model!r}: must be non-empty and hold no '{{' or '}}'")
    return model


def queue(model: str, worker_id: str) -> str:
    """Stream of requests routed to one worker of `model` (consumer group `workers`)."""
    return f"{PREFIX}:q:{slot_tag(model)}:{worker_id}"


def model_queue(model: str) -> str:
    """Stream of requests for one base model that no worker could take when they came (none serves it,
    or all were at capacity): a worker of that model whose own queue is empty moves entries from it onto
    its own (`request_record.STEAL`). Its length is the model's unplaced backlog: the autoscaling signal
    (KEDA's redis-streams `streamLength`). Consumer group `workers`, which no one reads: it is there so
    the shared cancel script finds an entry unread."""
    return f"{PREFIX}:mq:{slot_tag(model)}"


MODEL_QUEUE_PATTERN = f"{PREFIX}:mq:*"


def output(model: str, request_id: str) -> str:
    """Stream of one request's output events, in order; kept for a while so a client can resume."""
    return f"{PREFIX}:out:{slot_tag(model)}:{request_id}"


def worker_state(model: str, worker_id: str) -> str:
    """A worker's heartbeat: `WorkerState` JSON with a short TTL."""
    return f"{PREFIX}:w:{slot_tag(model)}:{worker_id}"


WORKER_STATE_PATTERN = f"{PREFIX}:w:*"
QUEUE_PATTERN = f"{PREFIX}:q:*"


def _glob(text: str) -> str:
    """`text` matched literally in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def queue_patterns(model: str | None = None) -> tuple[str, str]:
    """Glob patterns of the queues a request may wait in (workers' and shared): all, or one model's."""
    if model is None:
        return QUEUE_PATTERN, MODEL_QUEUE_PATTERN
    return f"{PREFIX}:q:{_glob(slot_tag(model))}:*", _glob(model_queue(model))


HEARTBEAT_S = 1.0  # a worker writes its heartbeat this often
HEARTBEAT_TTL_S = 3  # a worker's heartbeat key expires this long after its last beat


def events(model: str, worker_id: str) -> str:
    """Stream of a worker's KV-block and adapter residency events (precise routing index)."""
    return f"{PREFIX}:events:{slot_tag(model)}:{worker_id}"


def decision(decision_id: str) -> str:
    """A routing decision (JSON), kept for an hour for `/admin/decisions/{id}`."""
    return f"{PREFIX}:decision:{decision_id}"


DECISION_TTL_S = 3600  # how long a routing decision stays readable


EVENTS_PATTERN = f"{PREFIX}:events:*"
EVENTS_MAXLEN = 20_000  # a KV-event stream is trimmed to about this many entries


def of_worker_key(key: str) -> tuple[str, str]:
    """(model, worker id) of a worker's queue, heartbeat or event stream key."""
    tagged = key.split(":", 2)[2]  # "{model}:worker"
    model, _, worker_id = tagged[1:].partition("}:")
    return model, worker_id


def tag_of(key: str) -> str:
    """The hash tag of a key (Redis Cluster's rule: the first `{...}` with something inside), or the key."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


# hash: base model name -> {"model_dir", "max_model_len", "block_size", "at"} JSON (its workers' last beat)
MODELS = f"{PREFIX}:models"
MODEL_MEMORY_S = 7 * 24 * 3600  # a base model seen within this long is known (503 while down, not 404)


def request_record(model: str, request_id: str) -> str:
    """Hash of one request (by its tenant-scoped id): `fp`, a fingerprint of what was asked, and `queue`
    and `entry`, where its queue entry was added. Created together with that entry, once: a retry finds
    it and attaches to the request instead of queueing a copy."""
    return f"{PREFIX}:req:{slot_tag(model)}:{request_id}"


RECORD_FP, RECORD_QUEUE, RECORD_ENTRY = "fp", "queue", "entry"  # a request record's hash fields


OUTPUT_TTL_S = 600  # an output stream lives this long after its last write (so a client can resume)
REQUEST_RECORD_GRACE_S = 900  # a request's record outlives its deadline by this much (> OUTPUT_TTL_S)


def scoped_request_id(tenant: str, client_id: str) -> str:
    """A request's id inside loragate (every key, cancel message, the worker): the id its client sent
    (`X-Request-Id`) or was given, in the namespace of its tenant, so the same id sent by two tenants names
    two requests. `/` never occurs in a client id, so no id reaches into another namespace."""
    return f"{hashlib.sha256(tenant.encode()).hexdigest()[:24]}/{client_id}"


def client_request_id(request_id: str) -> str:
    """The id the client knows (the response's `id`), from a scoped request id."""
    return request_id.rpartition("/")[2]


class AdapterTier(StrEnum):
    """Where an adapter's fastest copy is on a worker: on the device, in host memory, or only on disk.
    NONE: the request has no adapter (routing's view of a request, never in an event)."""

    NONE = "none"
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


# -- worker -> gateway events on `events(worker_id)`, one JSON object in the entry's EVENTS_FIELD --------
#
# A worker appends one stream entry per event, its JSON in EVENTS_FIELD
# (`XADD lg:events:{model}:worker MAXLEN ~ EVENTS_MAXLEN * e <json>`), the same layout as the output streams:
#
#     {"type": "stored",  "hashes": [h1, h2, ...], "ts": 1718000000.0}   blocks now in its prefix cache
#     {"type": "evicted", "hashes": [h1, ...],     "ts": ...}            blocks dropped from it
#     {"type": "cleared", "ts": ...}                                      everything dropped (start, reset)
#     {"type": "adapter_loaded",  "adapter": "tiny:a", "tier": "device", "ts": ...}   moved to a faster tier
#     {"type": "adapter_evicted", "adapter": "tiny:a", "tier": "host",   "ts": ...}   moved to a slower tier
#
# `hashes` are the `loragate.hashing.block_hash` values of full blocks (unsigned 128-bit JSON integers),
# keyed by the adapter key `"{base}:{name}"` or none, exactly as the gateway computes them. In adapter
# events `tier` is where the adapter is *after* the event, its fastest copy: `"device"`, `"host"` or
# `"disk"` (no longer resident); the reader keeps the latest tier per adapter, so events are idempotent
# and the type only says which way it moved. `ts` is unix time, optional (0). A worker sends `cleared`
# when it starts, so a restarted worker's old blocks are forgotten.


class EventType(StrEnum):
    STORED = "stored"
    EVICTED = "evicted"
    CLEARED = "cleared"
    ADAPTER_LOADED = "adapter_loaded"
    ADAPTER_EVICTED = "adapter_evicted"


BLOCK_EVENTS = frozenset({EventType.STORED, EventType.EVICTED})
ADAPTER_EVENTS = frozenset({EventType.ADAPTER_LOADED, EventType.ADAPTER_EVICTED})
ADAPTER_TIERS = frozenset({AdapterTier.DEVICE, AdapterTier.HOST, AdapterTier.DISK})


@dataclass(frozen=True, slots=True)
class KVEvent:
    type: EventType
    hashes: tuple[int, ...] = ()  # stored / evicted
    adapter: str | None = None  # adapter_loaded / adapter_evicted
    tier: AdapterTier | None = None  # with adapter events: device, host or disk, where it is now
    ts: float = 0.0

    def __post_init__(self) -> None:
        if self.type in ADAPTER_EVENTS and (not self.adapter or self.tier not in ADAPTER_TIERS):
            raise ValueError(f"{self.type} needs an adapter and a tier in {sorted(ADAPTER_TIERS)}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": str(self.type)}
        if self.type in BLOCK_EVENTS:
            d["hashes"] = list(self.hashes)
        if self.type in ADAPTER_EVENTS:
            d["adapter"], d["tier"] = self.adapter, str(self.tier)
        if self.ts:
            d["ts"] = self.ts
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KVEvent:
        """Raises ValueError on an unknown type or malformed fields (a reader skips such an entry)."""
        kind = EventType(str(d.get("type")))
        hashes = d.get("hashes", ())
        if not isinstance(hashes, list | tuple) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes
        ):
            raise ValueError("hashes must be a list of integers")
        tier = d.get("tier")
        try:
            where = None if tier is None else AdapterTier(str(tier))
        except ValueError:
            raise ValueError(f"unknown tier {tier!r}") from None
        return KVEvent(kind, tuple(hashes), d.get("adapter"), where, float(d.get("ts", 0.0)))

    @staticmethod
    def from_json(raw: str | bytes) -> KVEvent:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("an event is a JSON object")
        return KVEvent.from_dict(d)
