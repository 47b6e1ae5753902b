"""The Redis key schema: every key and channel loragate uses, in one place (see docs/DESIGN.md)."""

from __future__ import annotations

import hashlib

PREFIX = "lg"
WORKER_GROUP = "workers"  # consumer group on every queue stream
ADAPTERS = f"{PREFIX}:adapters"  # hash: "{base}:{name}" -> AdapterRecord JSON
API_KEYS = f"{PREFIX}:keys"  # hash: sha256(api key) -> tenant name
POLICY = f"{PREFIX}:policy"  # hash: version -> {"version", "document", "created_at"} JSON
POLICY_ACTIVE = f"{PREFIX}:policy:active"  # the active version number
POLICY_SEQ = f"{PREFIX}:policy:seq"  # version counter
POLICY_SHADOW = f"{PREFIX}:policy:shadow"  # a candidate policy document evaluated beside the active one
POLICY_CHANGED = f"{PREFIX}:policy:changed"  # pub/sub: a new active or shadow policy
CANCEL = f"{PREFIX}:cancel"  # pub/sub: request ids whose client went away


def queue(worker_id: str) -> str:
    """Stream of requests routed to one worker (consumer group `workers`)."""
    return f"{PREFIX}:q:{worker_id}"


def output(request_id: str) -> str:
    """Stream of one request's output events, in order; kept for a while so a client can resume."""
    return f"{PREFIX}:out:{request_id}"


def worker_state(worker_id: str) -> str:
    """A worker's heartbeat: `WorkerState` JSON with a short TTL."""
    return f"{PREFIX}:w:{worker_id}"


WORKER_STATE_PATTERN = f"{PREFIX}:w:*"
QUEUE_PATTERN = f"{PREFIX}:q:*"


HEARTBEAT_TTL_S = 3  # a worker's heartbeat key expires this long after its last beat (it beats every second)


def events(worker_id: str) -> str:
    """Stream of a worker's KV-block and adapter residency events (precise routing index)."""
    return f"{PREFIX}:events:{worker_id}"


def decision(decision_id: str) -> str:
    """A routing decision (JSON), kept for an hour for `/admin/decisions/{id}`."""
    return f"{PREFIX}:decision:{decision_id}"


EVENTS_PATTERN = f"{PREFIX}:events:*"
EVENTS_MAXLEN = 20_000  # a KV-event stream is trimmed to about this many entries


def worker_id_of_queue(key: str) -> str:
    return key.removeprefix(f"{PREFIX}:q:")


MODELS = f"{PREFIX}:models"  # hash: base model name -> {"model_dir", "max_model_len", "at"} JSON (last beat)
MODEL_MEMORY_S = 7 * 24 * 3600  # a base model seen within this long is known (503 while down, not 404)


def request_record(request_id: str) -> str:
    """Hash of one request (by its tenant-scoped id): `fp`, a fingerprint of what was asked, and `queue`
    and `entry`, where its queue entry was added. Created together with that entry, once: a retry finds
    it and attaches to the request instead of queueing a copy."""
    return f"{PREFIX}:req:{request_id}"


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
