"""Worker choice for a request until the routing policies arrive.

Among workers serving the base model whose queue is under its bound: if some worker was recently sent
this prompt's leading blocks (approximate prefix index) and is not much busier than the least-loaded one
(`load <= min + prefix_slack`), take the one with the longest such prefix; otherwise the least-loaded
(load = outstanding requests: queued, waiting or running). Ties go to where the adapter already lives
(device, then host memory, then disk), then by id. Admission control: when every candidate's queue is
at its bound the request is refused with 429 and `Retry-After`, rather than piling up.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.catalog import Target
from gateway.errors import APIError
from gateway.fleet import Fleet, WorkerView


def adapter_tier(view: WorkerView, adapter_key: str | None) -> int:
    if adapter_key is None or adapter_key in view.state.adapters_device:
        return 0
    return 1 if adapter_key in view.state.adapters_host else 2


def pick_worker(
    fleet: Fleet,
    target: Target,
    max_queue: int,
    cached_blocks: Mapping[str, int] | None = None,
    prefix_slack: int = 8,
) -> WorkerView:
    candidates = fleet.serving(target.base)
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
    cached = cached_blocks or {}
    least = min(w.load for w in open_)
    affine = [w for w in open_ if cached.get(w.state.worker_id, 0) > 0 and w.load <= least + prefix_slack]
    if affine:
        return max(affine, key=lambda w: (cached[w.state.worker_id], -w.load, -adapter_tier(w, key)))
    return min(open_, key=lambda w: (w.load, adapter_tier(w, key), w.state.worker_id))
