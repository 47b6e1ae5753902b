"""The autoscaled simulation (`loadtest.sim_autoscale`): from zero workers, the first requests wait on the
shared stream through the cold start and are all served (none lost, their wait in their TTFT); a surge
adds workers up to what the demand asks, never past `max_workers`; when the load is gone the fleet
shrinks to `min_workers`, but only after the cooldown."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtest.fleet_real import fleet_policy
from loadtest.sim_autoscale import ScalingRule, Timeline, autoscale, rate_steps
from loadtest.sim_report import ProfileResult
from loadtest.sim_worker import EngineModel
from loadtest.sim_workload import SimWorkloadSpec, make_sim_workload
from loadtest.simulate import FleetSpec
from policies.document import parse_policy

RULE = ScalingRule(target=4.0, min_workers=0, max_workers=6, poll_s=1.0, cold_start_s=10.0, cooldown_s=30.0)
STEPS = [(20.0, 0.5), (40.0, 8.0), (20.0, 0.5), (60.0, 0.0)]


@pytest.fixture(scope="module")
def run() -> tuple[ProfileResult, Timeline, int]:
    pool = make_sim_workload(SimWorkloadSpec(num_requests=2000, rate=8.0, num_adapters=20, seed=2))
    requests = rate_steps(pool, STEPS, seed=2)
    fleet = FleetSpec(8, replace(EngineModel(), max_loras=4, host_adapters=20))
    profile = parse_policy(fleet_policy("default")).profile("default")
    result, timeline = autoscale(requests, profile, fleet, RULE, until_s=sum(d for d, _ in STEPS), seed=2)
    return result, timeline, len(requests)


def test_rate_steps_follow_the_steps() -> None:
    pool = make_sim_workload(SimWorkloadSpec(num_requests=500, rate=1.0, num_adapters=4, seed=1))
    requests = rate_steps(pool, [(10.0, 2.0), (10.0, 20.0), (10.0, 0.0), (10.0, 2.0)], seed=1)
    times = [r.arrival_s for r in requests]
    assert times == sorted(times) and all(0 <= t < 40 for t in times)
    counts = [sum(lo <= t < lo + 10 for t in times) for lo in (0, 10, 20, 30)]
    assert counts[2] == 0 and counts[1] > 4 * max(counts[0], counts[3])
    assert [r.request_id for r in requests] == [r.request_id for r in pool[: len(requests)]]


def test_from_zero_every_request_is_served_after_the_cold_start(
    run: tuple[ProfileResult, Timeline, int],
) -> None:
    result, timeline, count = run
    assert sum(result.served) == count and result.rejected == 0  # none lost while no worker was up
    first_live = next(t for t, live, *_ in timeline.points if live > 0)
    assert first_live >= RULE.cold_start_s  # no worker before the first one had started
    assert max(result.ttft_s) >= RULE.cold_start_s - 1  # the first requests' wait is in their TTFT
    assert timeline.points[0][1] == 0


def test_a_surge_adds_workers_within_bounds_and_they_go_after_the_cooldown(
    run: tuple[ProfileResult, Timeline, int],
) -> None:
    _, timeline, _ = run
    live = {round(t): n for t, n, *_ in timeline.points}
    assert max(live.values()) > 1 and max(n + s for _, n, s, *_ in timeline.points) <= RULE.max_workers
    surge_end = STEPS[0][0] + STEPS[1][0]
    assert max(live[t] for t in live if t < surge_end) == max(live.values())  # the peak is in the surge
    assert live[max(live)] == RULE.min_workers  # back to zero at the end
    idle_from = next(t for t, _, _, demand, waiting in timeline.points if t > surge_end and demand == 0)
    still = [n for t, n, *_ in timeline.points if idle_from <= t < idle_from + RULE.cooldown_s - RULE.poll_s]
    assert still and min(still) >= 1  # nobody removed within the cooldown after the load went
