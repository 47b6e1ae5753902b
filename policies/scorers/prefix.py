"""`prefix`: prefer the worker that already holds the longest leading run of the prompt's KV blocks.

Algorithm: `score = cached_blocks / len(request.block_hashes)`, the share of the prompt's full blocks the
worker can take from its prefix cache (`Candidate.cached_blocks` comes from `policies.prefix_index`:
precise from the workers' KV events, or approximate from what was routed where). A request without a
full block scores 0 everywhere, so the scorer is neutral for short prompts. Block hashes are chained and
keyed by adapter, so only KV computed under the same adapter counts.

Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.framework import Scorer
from policies.types import Candidate, RouteRequest


class PrefixScorer(Scorer):
    type_name = "prefix"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        blocks = len(request.block_hashes)
        if blocks == 0:
            return [0.0] * len(candidates)
        return [min(1.0, c.cached_blocks / blocks) for c in candidates]
