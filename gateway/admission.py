"""Admission: refuse what would wait too long, and queue the rest fairly across tenants.

First the overload check (`gateway.overload`, with `gateway.queue_estimate`): a request whose estimated
queue wait, or whose model's or tenant's queue, is over its configured bound is refused at once with 429
and a `Retry-After` from the measured drain rate. Then per-tenant fair queueing: when the fleet serving a
model is busy, requests wait in the gateway in a virtual-token-counter fair queue
(`policies.fairness.FairQueue`, one per base model) and are released in fair order as capacity frees, so
one tenant's flood cannot starve the others. Below the busy threshold nothing waits.

A model's free room is `Σ max(0, per_worker − outstanding)` over its live workers, where `per_worker` is
the configured bound or, by default, each worker's own batch capacity (`max_running`, its
`--max-num-seqs`): below it a request waits nowhere (the engine batches it in its next step), above it the
gateway's fair queue orders the backlog, since the engine would only queue it FCFS. Each tick releases at
most that many requests (they are counted on their worker as soon as they are routed). A request that
still waits after `max_wait_s` (a backstop: the wait bound should refuse it before it queues) is refused
with 429. With the model's shared stream on (`model_queue_max`) and no worker live, a request is admitted
at once: it waits on that stream, bounded there, for a worker to start. Tenants are charged the tokens
they were actually served when a request ends (the admission-time estimate is corrected), and each
finished request feeds the model's drain rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.fleet import Fleet
from gateway.overload import Limits, judge, retry_after
from gateway.queue_estimate import DrainMeter, Load, WorkerSlots, fleet_rate
from gateway.settings import GatewaySettings
from loragate.messages import WorkerState
from policies.fairness import FairQueue, token_cost

# Per-worker room for workers whose heartbeat does not give their batch capacity.
DEFAULT_PER_WORKER = 48


@dataclass(eq=False)
class _Ticket:
    tenant: str
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FairAdmission:
    def __init__(
        self,
        fleet: Fleet,
        per_worker: int = 0,
        max_wait_s: float = 30.0,
        tick_s: float = 0.005,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared_queue: bool = False,
    ):
        self.shared_queue = shared_queue  # with no live worker, requests wait on the model's shared stream
        self.fleet, self.per_worker, self.max_wait_s, self.tick_s = fleet, per_worker, max_wait_s, tick_s
        self.limits, self.clock = limits or Limits(), clock
        self.queues: dict[str, FairQueue[_Ticket]] = {}
        self.meters: dict[str, DrainMeter] = {}
        self.slots = WorkerSlots()
        self.waited = 0
        self.rejected: Counter[str] = Counter()  # 429s by error code
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def from_settings(fleet: Fleet, settings: GatewaySettings) -> FairAdmission:
        return FairAdmission(
            fleet,
            settings.fair_admission_per_worker,
            settings.fair_admission_max_wait_s,
            limits=Limits.from_settings(settings),
            shared_queue=settings.model_queue_max > 0,
        )

    def capacity(self, state: WorkerState) -> int:
        """Outstanding requests `state`'s worker takes before its model's requests queue fairly."""
        return self.per_worker or state.max_running or DEFAULT_PER_WORKER

    def room(self, base: str) -> int:
        return sum(max(0, self.capacity(w.state) - w.load) for w in self.fleet.serving(base))

    def waiting(self, base: str) -> int:
        q = self.queues.get(base)
        return len(q) if q is not None else 0

    def meter(self, base: str) -> DrainMeter:
        if (meter := self.meters.get(base)) is None:
            meter = self.meters[base] = DrainMeter(self.clock())
        return meter

    def load(self, base: str) -> Load:
        """The model's backlog, this gateway's fair queue and drain rate, as the overload check sees them."""
        now, meter, workers = self.clock(), self.meter(base), self.fleet.serving(base)
        queue = self.queues.get(base)
        drain = max(meter.rate(now), fleet_rate(workers, meter.tokens_per_request(now)))
        return Load(self.slots.backlog(workers), queue.queued() if queue is not None else {}, drain)

    async def admit(self, tenant: str, base: str, prompt_tokens: int, max_tokens: int) -> float:
        """Refuse (429) if over a bound; else wait for this request's fair turn if the model's workers are
        busy. Returns the charge made."""
        self.meter(base).asked(max_tokens)
        queue = self.queues.setdefault(base, FairQueue())
        estimate = token_cost(prompt_tokens, max_tokens)
        if self.shared_queue and not self.fleet.serving(base):
            # No worker to estimate a wait from or to wait for here: it waits on the model's shared stream
            # (bounded there) for the first worker to start.
            queue.charge(tenant, estimate)
            return estimate
        load = self.load(base)
        refusal = judge(self.limits, tenant, base, load)
        if refusal is not None:
            self.rejected[refusal.code] += 1
            raise refusal.error()
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
            self.rejected["overloaded"] += 1
            now = self.load(base)
            raise APIError(
                429,
                "The model is busy and this request waited too long for its fair turn.",
                code="overloaded",
                headers={"Retry-After": str(retry_after(now.ahead(tenant), now.drain_rps))},
            ) from None
        return estimate

    def settle(
        self, tenant: str, base: str, charged: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """The request ended: correct the tenant's charge; a served request counts toward the drain rate
        (one that never reached a worker settles with zero tokens and does not)."""
        queue = self.queues.setdefault(base, FairQueue())
        queue.charge(tenant, token_cost(prompt_tokens, completion_tokens) - charged)
        if prompt_tokens or completion_tokens:
            self.meter(base).finished(self.clock(), completion_tokens)

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
