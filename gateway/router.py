"""Worker choice for a request until the routing policies arrive: the least-loaded worker serving the
base model (load = running + waiting + queued), ties broken by where the adapter already lives (device,
then host memory, then disk) and then by id. Admission control: when every candidate's queue is at its
bound the request is refused with 429 and `Retry-After`, rather than piling up."""

from __future__ import annotations

from gateway.catalog import Target
from gateway.errors import APIError
from gateway.fleet import Fleet, WorkerView


def adapter_tier(view: WorkerView, adapter_key: str | None) -> int:
    if adapter_key is None or adapter_key in view.state.adapters_device:
        return 0
    return 1 if adapter_key in view.state.adapters_host else 2


def pick_worker(
    fleet: Fleet, target: Target, max_queue: int, exclude: frozenset[str] = frozenset()
) -> WorkerView:
    candidates = [w for w in fleet.serving(target.base) if w.state.worker_id not in exclude]
    if not candidates:
        raise APIError(
            503,
            f"No worker is serving '{target.base}' right now.",
            code="no_worker",
            headers={"Retry-After": "2"},
        )
    open_ = [w for w in candidates if w.queue_len < max_queue]
    if not open_:
        raise APIError(
            429,
            f"All workers serving '{target.base}' are at capacity; retry shortly.",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
    key = target.adapter.key if target.adapter else None
    return min(open_, key=lambda w: (w.load, adapter_tier(w, key), w.state.worker_id))
