"""Autoscaling in the routing simulator: how a model's workers follow its demand, KEDA-style.

The deployment's rule (deploy/kubernetes: a `metrics-api` trigger on the gateway's
`/admin/models/{model}/demand`, target `target` outstanding requests per worker, and the shared stream's
length as the activation signal) replayed on simulated workers:

- every `poll_s` the autoscaler reads demand = requests queued or running on the live workers + the
  requests waiting on the model's shared stream, and wants `ceil(demand / target)` workers (between
  `min_workers` and `max_workers`; at least one while anything waits);
- a worker it adds serves after `cold_start_s` (scheduling, pulling and loading the model); it removes
  an idle worker when no poll within the last `cooldown_s` wanted it (the HPA's scale-down stabilization);
- a request that no live worker can take waits on the shared stream (`model_queue_max` on); each new or
  freed worker takes the oldest waiting ones, as real workers steal from `lg:mq:{model}`.

The timeline (time, live workers, starting workers, demand, waiting) is what the fleet report plots.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from loadtest.sim_report import ProfileResult
from loadtest.sim_workload import SimRequest
from loadtest.simulate import HEARTBEAT, STEP_END, FleetSim, FleetSpec
from policies.routing_state import RoutingProfile

SCALE = 2  # event kind: the autoscaler's poll
READY = 3  # event kind: a started worker is ready


@dataclass(frozen=True, slots=True)
class ScalingRule:
    target: float = 8.0  # outstanding requests per worker
    min_workers: int = 0
    max_workers: int = 16
    poll_s: float = 2.0
    cold_start_s: float = 20.0
    cooldown_s: float = 60.0


@dataclass
class Timeline:
    points: list[tuple[float, int, int, int, int]] = field(
        default_factory=list
    )  # t, live, starting, demand, waiting


class AutoscaledSim(FleetSim):
    """A `FleetSim` whose `fleet.num_workers` is the pool the autoscaler may use."""

    def __init__(self, profile: RoutingProfile, fleet: FleetSpec, rule: ScalingRule, seed: int):
        super().__init__(profile, fleet, seed)
        self.rule = rule
        self.live: set[int] = set()
        self.starting: set[int] = set()
        self.waiting: deque[SimRequest] = deque()
        self.timeline = Timeline()
        self._wants: deque[tuple[float, int]] = deque()  # (time, workers wanted)
        self.routing.observe({}, keep_missing=False)
        for k in range(min(rule.min_workers, len(self.workers))):
            self.live.add(k)
        self._observe_live(0.0)

    def _observe_live(self, now: float) -> None:
        views = {self.workers[k].worker_id: self.heartbeat(self.workers[k], now) for k in self.live}
        self.routing.observe(views, keep_missing=False)

    def arrive(self, request: SimRequest, now: float | None = None) -> None:
        if not self.live or self.waiting:  # nobody to take it, or older requests wait first
            self.waiting.append(request)
            return
        before = self.rejected
        super().arrive(request, now)
        if self.rejected > before:  # every live worker at its bound: it waits on the shared stream
            self.rejected = before
            self.waiting.append(request)

    def _drain_waiting(self, now: float) -> None:
        while self.waiting and self.live:
            request = self.waiting[0]
            before = self.rejected
            super().arrive(request, now)
            if self.rejected > before:
                self.rejected = before
                return
            self.waiting.popleft()

    def scale(self, now: float) -> None:
        demand = sum(self.workers[k].outstanding for k in self.live) + len(self.waiting)
        want = max(math.ceil(demand / self.rule.target), int(bool(self.waiting)))
        want = max(self.rule.min_workers, min(self.rule.max_workers, len(self.workers), want))
        # Scale-down stabilization (the HPA's): the most workers wanted within the last `cooldown_s`.
        self._wants.append((now, want))
        while self._wants[0][0] < now - self.rule.cooldown_s:
            self._wants.popleft()
        keep = max(w for _, w in self._wants)
        have = len(self.live) + len(self.starting)
        if want > have:
            idle = [k for k in range(len(self.workers)) if k not in self.live and k not in self.starting]
            for k in idle[: want - have]:
                self.starting.add(k)
                self.push(now + self.rule.cold_start_s, READY, k)
        elif keep < len(self.live):
            for k in sorted(self.live, reverse=True):  # only idle workers go (a real one would drain)
                if len(self.live) > keep and self.workers[k].outstanding == 0:
                    self.live.discard(k)
            self._observe_live(now)
        self.timeline.points.append((now, len(self.live), len(self.starting), demand, len(self.waiting)))

    def run_scaled(self, requests: list[SimRequest], until_s: float) -> ProfileResult:
        """Replays `requests` with the autoscaler polling until `until_s` (after the last arrival, so the
        scale-down shows)."""
        for t in range(int(until_s / self.rule.poll_s) + 1):
            self.push(t * self.rule.poll_s, SCALE, 0)
        return self.run(requests)

    def handle(self, kind: int, k: int, now: float) -> bool:
        if kind == SCALE:
            self.scale(now)
            return True
        if kind == READY:
            self.starting.discard(k)
            self.live.add(k)
            self._observe_live(now)
            self.push(now + self.fleet.heartbeat_s, HEARTBEAT, k)
            self._drain_waiting(now)
            return True
        if kind == STEP_END:
            self.step_end(k, now)
            self._drain_waiting(now)
            return True
        return kind == HEARTBEAT and k not in self.live  # a removed worker beats no more


def rate_steps(
    requests: list[SimRequest], steps: list[tuple[float, float]], seed: int = 0
) -> list[SimRequest]:
    """`requests` re-timed as Poisson arrivals at a rate that changes in steps: (duration s, requests/s)
    each, in turn; the requests left over when the steps end are dropped."""
    rng = random.Random(seed)
    out: list[SimRequest] = []
    start = 0.0
    for duration, rate in steps:
        t = start
        while rate > 0 and len(out) < len(requests):
            t += rng.expovariate(rate)
            if t >= start + duration:
                break
            out.append(replace(requests[len(out)], arrival_s=t))
        start += duration
    return out


def autoscale(
    requests: list[SimRequest],
    profile: RoutingProfile,
    fleet: FleetSpec,
    rule: ScalingRule,
    until_s: float,
    seed: int = 0,
) -> tuple[ProfileResult, Timeline]:
    sim = AutoscaledSim(profile, fleet, rule, seed)
    result = sim.run_scaled(requests, until_s)
    return result, sim.timeline
