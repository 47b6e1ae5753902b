"""Per-tenant fair queueing by tokens served: the Virtual Token Counter (VTC).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Every tenant has a counter
of the (weighted) tokens it has been served. Admission always takes the next request of the waiting
tenant with the smallest counter, so a tenant that floods the queue only ever gets its share: once its
counter runs ahead, every other waiting tenant goes first until they catch up.

Counters must not bank idleness: a tenant that was away (or is new) would otherwise return with a low
counter and monopolise the server until it caught up. So a tenant that starts waiting is lifted to
`max(own, min counter over waiting tenants)`, or, when nobody waits, to the counter of the tenant that
last left the queue (the paper's rule).

Charging: `pop` charges the popped item's `cost_estimate` at once (a burst of admissions is fair before
any token is produced); when the request finishes, `charge(tenant, actual - estimate)` corrects it
(negative refunds an over-estimate). `token_cost` gives the paper's cost, prompt tokens weighted
`input_weight` and generated tokens `output_weight` (default 1 and 2: decoding costs more per token).

Parameters:
    weights: tenant → share (default 1 for every tenant): a tenant of weight 2 is charged half per token,
        so it gets twice the tokens of a weight-1 tenant when both are backlogged.

Ties (equal counters) go to the tenant whose next item has waited longest. O(waiting tenants) per pop.
A plain data structure: not thread-safe, owned by one admission task.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def token_cost(
    prompt_tokens: int, output_tokens: int, input_weight: float = 1.0, output_weight: float = 2.0
) -> float:
    return input_weight * prompt_tokens + output_weight * output_tokens


@dataclass(frozen=True, slots=True)
class _Entry(Generic[T]):
    seq: int  # arrival order, for ties
    item: T
    cost: float


class FairQueue(Generic[T]):
    def __init__(self, weights: Mapping[str, float] | None = None):
        self.weights = dict(weights or {})
        if any(w <= 0 for w in self.weights.values()):
            raise ValueError("tenant weights must be > 0")
        self._counters: dict[str, float] = {}
        self._waiting: dict[str, deque[_Entry[T]]] = {}
        self._arrivals = 0
        self._last_left: str | None = None

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    @property
    def waiting_tenants(self) -> tuple[str, ...]:
        return tuple(self._waiting)

    def queued(self) -> dict[str, int]:
        """Waiting items per waiting tenant."""
        return {tenant: len(q) for tenant, q in self._waiting.items()}

    def push(self, tenant: str, item: T, cost_estimate: float) -> None:
        if tenant not in self._waiting:
            self._counters[tenant] = max(self.counter(tenant), self._floor())
            self._waiting[tenant] = deque()
        self._waiting[tenant].append(_Entry(self._arrivals, item, cost_estimate))
        self._arrivals += 1

    def pop(self) -> T:
        """The next item of the waiting tenant with the smallest counter; IndexError when empty."""
        if not self._waiting:
            raise IndexError("pop from an empty FairQueue")
        tenant = min(self._waiting, key=lambda t: (self._counters[t], self._waiting[t][0].seq))
        queue = self._waiting[tenant]
        entry = queue.popleft()
        if not queue:
            del self._waiting[tenant]
            self._last_left = tenant
        self.charge(tenant, entry.cost)
        return entry.item

    def charge(self, tenant: str, tokens: float) -> None:
        """Adds `tokens` (weighted cost; negative refunds) to the tenant's counter."""
        self._counters[tenant] = self.counter(tenant) + tokens / self.weights.get(tenant, 1.0)

    def remove(self, tenant: str, item: T) -> bool:
        """Drops a waiting item (its client went away) without charging; False when it is not waiting."""
        queue = self._waiting.get(tenant)
        entry = next((e for e in queue or () if e.item == item), None)
        if queue is None or entry is None:
            return False
        queue.remove(entry)
        if not queue:
            del self._waiting[tenant]
            self._last_left = tenant
        return True

    def _floor(self) -> float:
        if self._waiting:
            return min(self._counters[t] for t in self._waiting)
        return self.counter(self._last_left) if self._last_left is not None else 0.0
