"""Small builders for routing inputs: a request and candidates with only the fields a test cares about."""

from __future__ import annotations

from typing import Any

from loragate.messages import WorkerState
from policies.types import Candidate, RouteRequest


def request(**fields: Any) -> RouteRequest:
    """A request for base `tiny` from tenant `t1` (100 prompt tokens, 50 max tokens) unless overridden."""
    values: dict[str, Any] = {
        "request_id": "r1",
        "tenant": "t1",
        "base": "tiny",
        "adapter": None,
        "prompt_tokens": 100,
        "max_tokens": 50,
    }
    values.update(fields)
    return RouteRequest(**values)


def candidate(
    worker_id: str = "w1",
    outstanding: int = 0,
    cached_blocks: int = 0,
    queued_tokens: int | None = None,
    **state: Any,
) -> Candidate:
    """A candidate serving `tiny` with 100 free of 100 KV blocks, heartbeat at t=1000, unless overridden."""
    values: dict[str, Any] = {
        "worker_id": worker_id,
        "model": "tiny",
        "model_dir": "/m",
        "max_model_len": 2048,
        "kv_blocks_free": 100,
        "kv_blocks_total": 100,
        "updated_at": 1000.0,
    }
    values.update(state)
    return Candidate(WorkerState(**values), outstanding, cached_blocks, queued_tokens)
