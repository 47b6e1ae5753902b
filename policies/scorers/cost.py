"""`cost`: prefer the worker with the smallest predicted time to first token (TTFT).

Algorithm: for each candidate,

    rate = state.prefill_tok_s, or default_prefill_tok_s when the worker has not measured one yet
    wait = queued_tokens / rate           when the caller knows the prompt tokens queued ahead of us
                                          (0 included: decoding requests do not delay a prefill much),
         = outstanding * request_s        otherwise (a per-request service estimate)
    load = the adapter's load cost for the tier it is in on that worker (`policies.load_cost`)
    ttft = wait + load + uncached_prompt_tokens / rate,  uncached = prompt - cached_blocks * block_size

and `score = (min_ttft + floor_s) / (ttft + floor_s)`: the fastest candidate scores 1, one predicted twice
as slow about ½. The score is relative to the other candidates, so it ranks but does not gate. `floor_s`
stands for the time every request pays anyway (the decode step it shares, scheduling): without it,
predictions of a few milliseconds would turn into large ratios and outweigh every other scorer.

Parameters:
    device_s, host_s, disk_s: the adapter load cost per tier in seconds (defaults 0, 0.005, 0.05).
    request_s: expected queueing delay each outstanding request adds, in seconds (default 0.02).
    default_prefill_tok_s: prefill rate assumed for workers that report none, tokens/s, > 0 (default 4000).
    floor_s: added to every prediction before taking ratios, in seconds, > 0 (default 0.05).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.framework import Scorer
from policies.load_cost import PARAMETER_NAMES, AdapterLoadCost
from policies.types import Candidate, RouteRequest


class CostScorer(Scorer):
    type_name = "cost"
    parameter_names = PARAMETER_NAMES | {"request_s", "default_prefill_tok_s", "floor_s"}

    def __init__(self, name: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(name, parameters)
        self.costs = AdapterLoadCost.from_plugin(self)
        self.request_s = self.param("request_s", 0.02, lo=0)
        self.default_prefill_tok_s = self.param("default_prefill_tok_s", 4000, lo=1e-9)
        self.floor_s = self.param("floor_s", 0.05, lo=1e-9)

    def predicted_ttft(self, request: RouteRequest, candidate: Candidate) -> float:
        """Predicted seconds until the request's first token on this candidate."""
        rate = candidate.state.prefill_tok_s or self.default_prefill_tok_s
        if candidate.queued_tokens is not None:
            wait = candidate.queued_tokens / rate
        else:
            wait = candidate.outstanding * self.request_s
        load = self.costs.seconds(candidate.tier(request.adapter))
        uncached = max(0, request.prompt_tokens - candidate.cached_blocks * request.block_size)
        return wait + load + uncached / rate

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        ttfts = [self.predicted_ttft(request, c) for c in candidates]
        best = min(ttfts, default=0.0)
        return [(best + self.floor_s) / (t + self.floor_s) for t in ttfts]
