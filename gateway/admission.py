"""Per-tenant fair admission: when the fleet serving a model is busy, requests wait in the gateway in a
virtual-token-counter fair queue (`policies.fairness.FairQueue`, one per base model) and are released in
fair order as capacity frees, so one tenant's flood cannot starve the others. Below the busy threshold
nothing waits.

A model's free room is `Σ max(0, per_worker − outstanding)` over its live workers; each tick releases at
most that many requests (they are counted on their worker as soon as they are routed). A request that
waits longer than `max_wait_s` is refused with 429. Tenants are charged the tokens they were actually
served when a request ends (the admission-time estimate is corrected).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.fleet import Fleet
from policies.fairness import FairQueue, token_cost


@dataclass(eq=False)
class _Ticket:
    tenant: str
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FairAdmission:
    def __init__(self, fleet: Fleet, per_worker: int = 48, max_wait_s: float = 30.0, tick_s: float = 0.005):
        self.fleet, self.per_worker, self.max_wait_s, self.tick_s = fleet, per_worker, max_wait_s, tick_s
        self.queues: dict[str, FairQueue[_Ticket]] = {}
        self.waited = 0
        self._task: asyncio.Task[None] | None = None

    def room(self, base: str) -> int:
        return sum(max(0, self.per_worker - w.load) for w in self.fleet.serving(base))

    def waiting(self, base: str) -> int:
        q = self.queues.get(base)
        return len(q) if q is not None else 0

    async def admit(self, tenant: str, base: str, prompt_tokens: int, max_tokens: int) -> float:
        """Wait for this request's fair turn if the model's workers are busy; returns the charge made."""
        queue = self.queues.setdefault(base, FairQueue())
        estimate = token_cost(prompt_tokens, max_tokens)
        if not len(queue) and self.room(base) > 0:
            queue.charge(tenant, estimate)
            return estimate
        ticket = _Ticket(tenant)
        queue.push(tenant, ticket, estimate)  # charged when popped
        self.waited += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._release())
        try:
            await asyncio.wait_for(asyncio.shield(ticket.ready), self.max_wait_s)
        except TimeoutError:
            if not queue.remove(tenant, ticket):
                queue.charge(tenant, -estimate)
            raise APIError(
                429,
                "The model is busy and this request waited too long for its fair turn.",
                code="overloaded",
                headers={"Retry-After": "2"},
            ) from None
        return estimate

    def settle(
        self, tenant: str, base: str, charged: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        queue = self.queues.setdefault(base, FairQueue())
        queue.charge(tenant, token_cost(prompt_tokens, completion_tokens) - charged)

    async def _release(self) -> None:
        while any(len(q) for q in self.queues.values()):
            for base, queue in self.queues.items():
                room = self.room(base)
                while room > 0 and len(queue):
                    with contextlib.suppress(asyncio.InvalidStateError):
                        queue.pop().ready.set_result(None)
                    room -= 1
            await asyncio.sleep(self.tick_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
