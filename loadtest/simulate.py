"""Offline routing simulator: replay one workload against N simulated workers under each routing profile.

A discrete-event simulation in simulated seconds (deterministic for a seed, pure Python). The workload
(`loadtest.sim_workload`) is Poisson arrivals of adapter requests on shared system prompts; each worker
(`loadtest.sim_worker`) is an engine cost model with an LRU prefix cache, LRU adapter slots over a host
tier, and continuous batching. Routing is the real thing: the gateway's own
`policies.routing_state.RoutingState`, whose `route` builds the candidates and runs the profile: the
worker's `WorkerState` from its last heartbeat (every `heartbeat_s`, so slightly stale; `observe`),
`outstanding` and `queued_tokens` fresh (each routed request's `Reservation` is counted at once, its
`first_token` and `release` called when the simulated worker prefills and finishes it), and
`cached_blocks` from its `PrefixIndex` fed by the workers' KV stored/evicted events and by what was
routed where (which covers the gap before a new prefix's `stored` event).

Definitions:
- utilisation: arrival rate / the fleet's saturation throughput (full batches, no cache hits, no adapter
  loads; `EngineModel.saturation_rps`); the default rate loads the fleet to 70 %.
- prefix hit rate: cached prompt tokens / prompt tokens, counted at admission.
- oracle: one worker holding the whole fleet's cache capacity (`workers × cache_blocks`) with the same
  LRU cache, fed every request in arrival order with its blocks cached at once: a placement that never
  splits a prefix over workers nor moves one for load. `prefix_hit_vs_oracle` is what routing loses by
  splitting the cache. Beside it, the bound: the same worker evicting by Belady's clairvoyant rule, which
  no placement can beat; the gap between the two is what LRU loses to one-off blocks, which routing
  cannot win back (`loadtest.sim_oracle`).
- adapter loads: disk→device plus host→device loads, summed over the fleet.
- load balance: requests served per worker, max / mean.
- warm-up: every figure counts only requests after the first `--warmup` share (20 %), so that empty
  caches and adapter tiers at start-up (a cold start every policy pays, round-robin eight times over) do
  not stand in for the steady state.

Run `python -m loadtest.simulate` (see `--help`); it prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadtest.sim_oracle import belady_hit_rate, lru_hit_rate
from loadtest.sim_paged import PagedSimWorker
from loadtest.sim_report import Oracles, ProfileResult, plot, report, table
from loadtest.sim_worker import EngineModel, SimWorker, SimWorkerBase
from loadtest.sim_workload import BASE_MODEL, BLOCK_SIZE, SimRequest, SimWorkloadSpec, make_sim_workload
from loragate.contracts import EventType, KVEvent
from policies.default_policy import DEFAULT_POLICY
from policies.document import load_policy_file, parse_policy
from policies.prefix_index import PrefixIndex
from policies.routing_state import Reservation, RoutingProfile, RoutingState, WorkerView, make_route_request
from policies.types import RouteRequest

PROFILES = ("default", "least-loaded", "round-robin", "random")
STEP_END, HEARTBEAT = 0, 1


ProfileSource = Callable[[str], RoutingProfile]  # profile name -> a fresh profile (pickers may keep state)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    num_workers: int = 8
    engine: EngineModel = field(default_factory=EngineModel)
    heartbeat_s: float = 1.0  # the real worker beats every second (worker.service)
    queued_tokens: bool = True  # tell routing the prompt tokens queued ahead (the gateway can count them)
    record_routed: bool = True  # also feed the prefix index what was routed where, not only KV events


def sim_route_request(request: SimRequest, now: float) -> RouteRequest:
    """What routing sees of a simulated request: the gateway's `make_route_request` at time `now`."""
    return make_route_request(
        request_id=request.request_id,
        tenant=request.tenant,
        base=BASE_MODEL,
        adapter=request.adapter,
        prompt_tokens=request.prompt_tokens,
        max_tokens=request.output_tokens,
        block_hashes=request.block_hashes,
        block_size=BLOCK_SIZE,
        now=now,
    )


class FleetSim:
    """One profile's run: the event loop, the gateway's routing state (heartbeats feed its fleet view,
    the workers' KV events its prefix index), and the reservations of the requests in flight."""

    def __init__(self, profile: RoutingProfile, fleet: FleetSpec, seed: int):
        self.profile, self.fleet, self.rng = profile, fleet, random.Random(seed)
        self.routing = RoutingState(PrefixIndex(), fleet.queued_tokens, fleet.record_routed)
        width = len(str(fleet.num_workers - 1))  # ids sort in worker order, as routing lists them
        self.workers = [
            (PagedSimWorker if fleet.engine.shared_kv else SimWorker)(
                f"w{k:0{width}d}", fleet.engine, BASE_MODEL, self.on_kv_event
            )
            for k in range(fleet.num_workers)
        ]
        self.index_of = {w.worker_id: k for k, w in enumerate(self.workers)}
        self.routing.observe({w.worker_id: self.heartbeat(w, 0.0) for w in self.workers})
        self.reservations: dict[str, Reservation] = {}  # by request id, until the request finishes
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind, order, worker index)
        self.order = 0
        self.rejected = 0
        self.measure_from_s = 0.0

    @property
    def index(self) -> PrefixIndex:
        return self.routing.index

    @staticmethod
    def heartbeat(worker: SimWorkerBase, now: float) -> WorkerView:
        """The worker's state as it would publish it, and its queue length (exact, as XLEN is)."""
        return WorkerView(worker.state(now), worker.outstanding)

    def on_kv_event(self, worker_id: str, stored: Sequence[int], evicted: Sequence[int]) -> None:
        if stored:
            self.index.apply_event(worker_id, KVEvent(EventType.STORED, tuple(stored)))
        if evicted:
            self.index.apply_event(worker_id, KVEvent(EventType.EVICTED, tuple(evicted)))

    def push(self, t: float, kind: int, k: int) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, kind, self.order, k))

    def kick(self, k: int, now: float) -> None:
        worker = self.workers[k]
        if not worker.busy and (duration := worker.start_step()) is not None:
            self.push(now + duration, STEP_END, k)

    def arrive(self, request: SimRequest, now: float | None = None) -> None:
        """Route `request` at `now` (its arrival by default; later when it waited to be placed)."""
        now = request.arrival_s if now is None else now
        routed = self.routing.route(
            self.profile, sim_route_request(request, now), self.rng, request.request_id
        )
        if routed.reservation is None:
            self.rejected += now >= self.measure_from_s
            return
        routed.reservation.commit()  # queued at once: no Redis in between
        self.reservations[request.request_id] = routed.reservation
        k = self.index_of[routed.reservation.worker_id]
        self.workers[k].enqueue(request)
        self.kick(k, now)

    def handle(self, kind: int, k: int, now: float) -> bool:
        """An event a subclass handles itself (True), before the step ends and heartbeats here."""
        return False

    def step_end(self, k: int, now: float) -> None:
        worker = self.workers[k]
        for seq in worker.admitted:  # prefilled in this step: their first token is out
            self.reservations[seq.request.request_id].first_token()
        for finished in worker.finish_step(now):
            self.reservations.pop(finished.request_id).release()
        self.kick(k, now)

    def run(self, requests: Sequence[SimRequest], warmup: int = 0) -> ProfileResult:
        """Replays `requests` (sorted by arrival); the first `warmup` of them are not measured."""
        started = time.perf_counter()
        self.measure_from_s = requests[warmup].arrival_s if warmup < len(requests) else float("inf")
        for w in self.workers:
            w.measure_from_s = self.measure_from_s
        beat = self.fleet.heartbeat_s
        for k in range(len(self.workers)):
            self.push(beat * k / len(self.workers), HEARTBEAT, k)
        i, now = 0, 0.0
        while i < len(requests) or self.events:
            if self.events and (i == len(requests) or self.events[0][0] <= requests[i].arrival_s):
                now, kind, _, k = heapq.heappop(self.events)
                if self.handle(kind, k, now):
                    continue
                if kind == STEP_END:
                    self.step_end(k, now)
                elif i < len(requests):  # heartbeats only matter while requests still arrive
                    worker = self.workers[k]
                    self.routing.observe({worker.worker_id: self.heartbeat(worker, now)}, keep_missing=True)
                    self.push(now + beat, HEARTBEAT, k)
            else:
                self.arrive(requests[i])
                i += 1
        stats = [w.stats for w in self.workers]
        steps = sum(s.steps for s in stats)
        return ProfileResult(
            name="",
            prompt_tokens=sum(s.prompt_tokens for s in stats),
            cached_tokens=sum(s.cached_tokens for s in stats),
            disk_loads=sum(s.disk_loads for s in stats),
            host_loads=sum(s.host_loads for s in stats),
            ttft_s=[t for s in stats for t in s.ttft_s],
            served=[s.served for s in stats],
            tokens=[s.tokens for s in stats],
            rejected=self.rejected,
            sim_s=now,
            mean_batch=sum(s.batch_sum for s in stats) / steps if steps else 0.0,
            wall_s=time.perf_counter() - started,
        )


def simulate(
    requests: Sequence[SimRequest],
    profile: RoutingProfile,
    fleet: FleetSpec,
    seed: int = 0,
    name: str = "",
    warmup: int = 0,
) -> ProfileResult:
    result = FleetSim(profile, fleet, seed).run(requests, warmup)
    result.name = name
    return result


def default_rate(spec: SimWorkloadSpec, fleet: FleetSpec, utilisation: float) -> float:
    per_worker = fleet.engine.saturation_rps(spec.mean_prompt_tokens, spec.mean_output_tokens)
    return utilisation * per_worker * fleet.num_workers


def policy_profiles(policy_file: str | None = None) -> ProfileSource:
    """Profiles of `policy_file` (YAML/JSON) or of DEFAULT_POLICY, parsed afresh for every run."""

    def profile(name: str) -> RoutingProfile:
        policy = load_policy_file(policy_file) if policy_file else parse_policy(DEFAULT_POLICY)
        return policy.profile(name)

    return profile


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    about = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m loadtest.simulate", description=about)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--system-prompts", type=int, default=40)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=0.2, help="share of requests not measured (cold start)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: from --utilisation)")
    p.add_argument("--utilisation", type=float, default=0.7, help="load as a share of saturation")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--base-fraction", type=float, default=0.15)
    p.add_argument(
        "--system-affinity", type=float, default=0.8, help="chance a request uses its adapter's own prompt"
    )
    p.add_argument("--max-loras", type=int, default=EngineModel().max_loras)
    p.add_argument("--host-adapters", type=int, default=EngineModel().host_adapters)
    p.add_argument("--cache-blocks", type=int, default=EngineModel().cache_blocks, help="per worker")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--no-queued-tokens", action="store_true", help="routing does not see queued tokens")
    p.add_argument("--events-only", action="store_true", help="prefix index from KV events only")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--policy", default=None, help="a YAML/JSON policy document (default: DEFAULT_POLICY)")
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    args = p.parse_args(argv)

    engine = replace(
        EngineModel(),
        max_loras=args.max_loras,
        host_adapters=args.host_adapters,
        cache_blocks=args.cache_blocks,
    )
    fleet = FleetSpec(args.workers, engine, args.heartbeat, not args.no_queued_tokens, not args.events_only)
    spec = SimWorkloadSpec(
        num_requests=args.requests,
        num_adapters=args.adapters,
        num_system_prompts=args.system_prompts,
        zipf_s=args.zipf,
        base_fraction=args.base_fraction,
        system_affinity=args.system_affinity,
        seed=args.seed,
    )
    rate = args.rate or default_rate(spec, fleet, args.utilisation)
    spec = replace(spec, rate=rate)
    saturation = default_rate(spec, fleet, 1.0)
    requests = make_sim_workload(spec)
    source = policy_profiles(args.policy)
    names = [n for n in args.profiles.split(",") if n]
    warmup = int(args.warmup * len(requests))
    results = {name: simulate(requests, source(name), fleet, args.seed, name, warmup) for name in names}
    capacity = fleet.num_workers * engine.cache_blocks
    oracles = Oracles(lru_hit_rate(requests, capacity, warmup), belady_hit_rate(requests, capacity, warmup))
    print(
        f"{args.requests} requests at {rate:.1f}/s "
        f"(utilisation {rate / saturation:.0%} of {saturation:.1f}/s), "
        f"{args.workers} workers, {args.adapters} adapters (Zipf {args.zipf}), "
        f"{args.system_prompts} system prompts, seed {args.seed}; the first {warmup} requests are warm-up"
    )
    print(table(results, oracles))
    if args.plot:
        plot(results, oracles, args.plot)
    meta = {
        "workers": args.workers,
        "adapters": args.adapters,
        "system_prompts": args.system_prompts,
        "requests": args.requests,
        "warmup_requests": warmup,
        "seed": args.seed,
        "rate": round(rate, 2),
        "utilisation": round(rate / saturation, 3),
        "policy": args.policy or "DEFAULT_POLICY",
    }
    summary = report(results, oracles, meta)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
