"""The routing simulator: deterministic for a seed, the oracle bounds every profile's prefix hit rate,
round-robin spreads requests evenly, prefix-aware routing beats random placement on cache hits, TTFT
is queue wait + adapter load + uncached prefill, and the CLI's last line is the JSON summary."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from loadtest.sim_oracle import belady_hit_rate, lru_hit_rate
from loadtest.sim_worker import EngineModel, SimWorker
from loadtest.sim_workload import BASE_MODEL, BLOCK_SIZE, SimRequest, SimWorkloadSpec, make_sim_workload
from loadtest.simulate import (
    FleetSim,
    FleetSpec,
    ProfileResult,
    default_rate,
    main,
    policy_profiles,
    simulate,
)
from loragate.hashing import block_hashes
from policies.routing_state import RoutingState

FLEET = FleetSpec(
    num_workers=2, engine=replace(EngineModel(), cache_blocks=256, max_loras=4, host_adapters=8)
)
SPEC = SimWorkloadSpec(num_requests=300, num_adapters=20, num_system_prompts=8, seed=3)


def request(hashes: tuple[int, ...], prompt: int, adapter: str | None, output: int = 3) -> SimRequest:
    return SimRequest("r", "t", adapter, 0.0, prompt, output, hashes)


@pytest.fixture(scope="module")
def requests() -> list[SimRequest]:
    return make_sim_workload(replace(SPEC, rate=default_rate(SPEC, FLEET, 0.7)))


@pytest.fixture(scope="module")
def results(requests: list[SimRequest]) -> dict[str, ProfileResult]:
    source = policy_profiles()
    return {
        name: simulate(requests, source(name), FLEET, seed=1, name=name)
        for name in ("default", "least-loaded", "round-robin", "random")
    }


def test_workload_hashes_are_the_fleets_own_and_keyed_by_adapter() -> None:
    spec = replace(SPEC, num_requests=60, system_affinity=0.0)
    reqs = make_sim_workload(spec)
    assert make_sim_workload(spec) == reqs
    assert all(len(r.block_hashes) == r.prompt_tokens // BLOCK_SIZE for r in reqs)
    # The first block of a system prompt is shared by requests with the same adapter, never across adapters.
    firsts: dict[int, set[str | None]] = {}
    for r in reqs:
        firsts.setdefault(r.block_hashes[0], set()).add(r.adapter)
    assert all(len(adapters) == 1 for adapters in firsts.values())
    assert len(firsts) < len(reqs), "some requests share a system prompt's first block"
    assert block_hashes([9] * 32, BLOCK_SIZE, "a") != block_hashes([9] * 32, BLOCK_SIZE, "b")


def test_same_seed_same_run(requests: list[SimRequest], results: dict[str, ProfileResult]) -> None:
    again = simulate(requests, policy_profiles()("default"), FLEET, seed=1, name="default")
    first = results["default"]
    assert again.ttft_s == first.ttft_s
    assert (again.served, again.cached_tokens, again.disk_loads, again.host_loads) == (
        first.served,
        first.cached_tokens,
        first.disk_loads,
        first.host_loads,
    )


def test_single_worker_oracles_bound_the_fleet(
    requests: list[SimRequest], results: dict[str, ProfileResult]
) -> None:
    capacity = FLEET.num_workers * FLEET.engine.cache_blocks
    bound, oracle = belady_hit_rate(requests, capacity), lru_hit_rate(requests, capacity)
    assert bound >= oracle > 0.2
    for r in results.values():
        assert r.hit_rate <= bound, r.name
    # Placements that ignore prefixes split every prefix over the workers: well under one shared cache.
    for name in ("least-loaded", "round-robin", "random"):
        assert results[name].hit_rate < 0.9 * oracle, name


def test_belady_bound_keeps_the_block_needed_soonest() -> None:
    # Capacity 2. A = blocks (1, 2), B = (3, 4). Sequence A B A: LRU evicts A for B and misses A again;
    # Belady bypasses B (never used again) and keeps A.
    a, b = request((1, 2), 33, None), request((3, 4), 33, None)
    assert lru_hit_rate([a, b, a], 2) == 0.0
    assert belady_hit_rate([a, b, a], 2) == pytest.approx(32 / 99)


def test_every_request_is_served_once(requests: list[SimRequest], results: dict[str, ProfileResult]) -> None:
    for r in results.values():
        assert sum(r.served) == len(requests) and len(r.ttft_s) == len(requests) and r.rejected == 0
        assert sum(r.tokens) == sum(q.prompt_tokens + q.output_tokens for q in requests)


def test_round_robin_spreads_requests_evenly(results: dict[str, ProfileResult]) -> None:
    served = results["round-robin"].served
    assert max(served) - min(served) <= 1


def test_prefix_aware_routing_beats_random_on_hits_and_adapter_loads(
    results: dict[str, ProfileResult],
) -> None:
    full, rand = results["default"], results["random"]
    assert full.hit_rate > rand.hit_rate + 0.05
    assert full.adapter_loads < rand.adapter_loads


@pytest.mark.parametrize(
    ("resident", "load_s"),
    [
        pytest.param("device", 0.0, id="adapter-on-device"),
        pytest.param("host", 0.005, id="adapter-in-host-memory"),
        pytest.param("disk", 0.050, id="adapter-on-disk"),
    ],
)
def test_ttft_on_an_idle_worker_is_adapter_load_plus_uncached_prefill(resident: str, load_s: float) -> None:
    model = EngineModel(prefill_tok_s=1000.0)
    worker = SimWorker("w0", model, BASE_MODEL)
    adapter = f"{BASE_MODEL}:a"
    if resident == "device":
        worker.tiers.device[adapter] = worker.tiers.host[adapter] = None
    elif resident == "host":
        worker.tiers.host[adapter] = None
    hashes = tuple(range(1, 11))  # 10 full blocks, 165 tokens
    worker.cache.update(dict.fromkeys(hashes[:6]))  # 6 leading blocks cached: 96 tokens
    worker.enqueue(request(hashes, 165, adapter))
    duration = worker.start_step()
    assert duration == pytest.approx(load_s + (165 - 96) / 1000.0)
    worker.finish_step(load_s + 0.069)
    assert worker.stats.ttft_s == [pytest.approx(load_s + 0.069)]
    assert worker.stats.cached_tokens == 96 and tuple(worker.cache)[-4:] == hashes[6:]


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    worker = SimWorker("w0", EngineModel(prefill_tok_s=1000.0), BASE_MODEL)
    hashes = (1, 2)
    worker.cache.update(dict.fromkeys(hashes))
    worker.enqueue(request(hashes, 32, None))
    assert worker.start_step() == pytest.approx(0.001)


def test_a_fixed_cache_keeps_its_size_while_a_generation_runs() -> None:
    """Without `shared_kv` the prefix cache is a fixed share of memory beside the running sequences (the
    paged pool is `loadtest.sim_paged`'s, tested in test_sim_paged.py)."""
    model = EngineModel(cache_blocks=8, kv_blocks=8, prefill_tok_s=1e6)
    worker = SimWorker("w0", model, BASE_MODEL)
    worker.enqueue(request((), 16, None, output=100))  # one full private block, then its output's
    worker.start_step()
    worker.finish_step(0.0)
    for _ in range(40):  # 41 tokens generated: 57 tokens, 4 private blocks
        worker.start_step()
        worker.finish_step(0.0)
    worker.enqueue(request(tuple(range(100, 106)), 96, None))  # 6 prompt blocks to cache
    worker.start_step()
    worker.finish_step(0.0)
    assert len(worker.cache) == 6


def test_queued_request_waits_for_the_step_ahead_and_shares_the_decode_step() -> None:
    model = EngineModel(prefill_tok_s=1000.0, decode_step_s=0.01, decode_step_per_seq_s=0.0)
    sim = FleetSim(policy_profiles()("round-robin"), replace(FLEET, num_workers=1, engine=model), seed=0)
    first = SimRequest("a", "t", None, 0.0, 100, 5, ())
    second = SimRequest("b", "t", None, 0.01, 50, 5, ())
    sim.run([first, second])
    # a: prefill 0.1 s alone. b arrives during it, waits until 0.1, then prefill 0.05 + a's decode 0.01.
    assert sim.workers[0].stats.ttft_s == [pytest.approx(0.1), pytest.approx(0.16 - 0.01)]


def test_adapter_waits_for_a_free_slot() -> None:
    worker = SimWorker("w0", EngineModel(max_loras=1, host_adapters=1), BASE_MODEL)
    worker.enqueue(request((), 8, f"{BASE_MODEL}:a", output=2))
    worker.enqueue(request((), 8, f"{BASE_MODEL}:b", output=2))
    worker.start_step()
    assert [s.request.adapter for s in worker.admitted] == [f"{BASE_MODEL}:a"]
    worker.finish_step(1.0)
    worker.start_step()  # a still decodes: b cannot take its slot
    assert worker.admitted == [] and len(worker.waiting) == 1
    worker.finish_step(2.0)  # a finishes
    worker.start_step()
    assert [s.request.adapter for s in worker.admitted] == [f"{BASE_MODEL}:b"]
    assert (worker.stats.disk_loads, worker.stats.host_loads) == (2, 0)


def test_cli_last_line_is_the_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--workers", "2", "--adapters", "10", "--system-prompts", "4", "--requests", "150", "--seed", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    for key in (
        "prefix_hit_vs_oracle",
        "adapter_loads_vs_round_robin",
        "p99_ttft_vs_round_robin",
        "p99_ttft_vs_least_loaded",
        "max_load_vs_mean",
    ):
        assert isinstance(summary[key], float), key
    assert set(summary["profiles"]) == {"default", "least-loaded", "round-robin", "random"}


def test_the_simulator_routes_through_the_gateways_routing_state(requests: list[SimRequest]) -> None:
    sim = FleetSim(policy_profiles()("default"), FLEET, seed=1)
    assert isinstance(sim.routing, RoutingState)
    sim.run(requests[:100])
    # Every request released its reservation: nothing outstanding, no prompt tokens queued.
    assert sim.reservations == {} and sim.routing.queued_tokens == {}
    assert [v.queue_len for v in sim.routing.workers.values()] == [0] * FLEET.num_workers
    assert sum(sim.index.size(w.worker_id) for w in sim.workers) > 0  # routed and stored blocks


def test_simulated_worker_ids_sort_in_worker_order() -> None:
    sim = FleetSim(policy_profiles()("round-robin"), replace(FLEET, num_workers=12), seed=0)
    ids = [w.worker_id for w in sim.workers]
    assert ids == sorted(ids) and ids[:2] == ["w00", "w01"]
