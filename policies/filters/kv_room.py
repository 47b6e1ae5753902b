"""`kv-room`: drop workers whose free KV cache cannot hold the request right now.

Algorithm: the worker's free KV tokens, `kv_blocks_free * block_size`, must hold the prompt tokens it
does not already cache (`prompt_tokens - cached_blocks * block_size`) plus decode headroom
`headroom_tokens + max_tokens_fraction * max_tokens`. A worker that reports no KV size
(`kv_blocks_total == 0`) is kept: unknown is not full. Workers preempt rather than fail when KV runs out,
so this filter avoids preemption storms; it is not needed for correctness.

Parameters:
    headroom_tokens: fixed decode headroom, in tokens (default 16).
    max_tokens_fraction: share of the request's `max_tokens` to reserve as well, in [0, 1] (default 0.25).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.framework import Filter
from policies.types import Candidate, RouteRequest


class KVRoom(Filter):
    type_name = "kv-room"
    capacity = True
    parameter_names = frozenset({"headroom_tokens", "max_tokens_fraction"})

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.headroom_tokens = self.param("headroom_tokens", 16, lo=0)
        self.max_tokens_fraction = self.param("max_tokens_fraction", 0.25, lo=0, hi=1)

    def needed_tokens(self, request: RouteRequest, candidate: Candidate) -> float:
        cached = candidate.cached_blocks * request.block_size
        uncached = max(0, request.prompt_tokens - cached)
        return uncached + self.headroom_tokens + self.max_tokens_fraction * request.max_tokens

    def keep(self, request: RouteRequest, candidate: Candidate) -> bool:
        state = candidate.state
        if state.kv_blocks_total == 0:
            return True
        return state.kv_blocks_free * state.block_size >= self.needed_tokens(request, candidate)
