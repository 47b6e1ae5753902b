"""The simulated worker over the real scheduler and KV block manager (`loadtest.sim_paged`): its KV events
carry the gateway's block hashes, a finished request's prompt is hit by the next, running sequences and
cached prefixes share one pool (a request waits for KV; nothing is lost), long prompts prefill in chunks,
and a fleet with `shared_kv` runs on it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtest.sim_paged import PagedSimWorker
from loadtest.sim_worker import EngineModel
from loadtest.sim_workload import BASE_MODEL, BLOCK_SIZE, SimRequest, SimWorkloadSpec, make_sim_workload
from loadtest.simulate import FleetSpec, default_rate, policy_profiles, simulate
from loragate.hashing import block_hashes

MODEL = EngineModel(kv_blocks=64, max_num_seqs=8, prefill_tok_s=1000.0, decode_step_s=0.01, shared_kv=True)


def make(
    prompt: list[int], output: int = 3, adapter: str | None = None, rid: str = "r", at: float = 0.0
) -> SimRequest:
    hashes = tuple(block_hashes(prompt, BLOCK_SIZE, adapter))
    return SimRequest(rid, "t", adapter, at, len(prompt), output, hashes, tuple(prompt))


def run_to_end(worker: PagedSimWorker, now: float = 0.0) -> float:
    while (duration := worker.start_step()) is not None:
        now += duration
        worker.finish_step(now)
    return now


def test_kv_events_carry_the_requests_block_hashes_and_the_next_request_hits_them() -> None:
    events: list[tuple[list[int], list[int]]] = []
    worker = PagedSimWorker("w0", MODEL, BASE_MODEL, lambda _w, s, e: events.append((list(s), list(e))))
    system = list(range(100, 164))  # 4 full blocks
    first = make([*system, 1, 2, 3], adapter=f"{BASE_MODEL}:a", rid="a")
    worker.enqueue(first)
    run_to_end(worker)
    stored = [h for s, _ in events for h in s]
    assert stored[:4] == list(first.block_hashes)  # the prompt's blocks first, as the gateway hashes them
    assert worker.cached_run(first.block_hashes) == 4
    second = make([*system, 7, 8], adapter=f"{BASE_MODEL}:a", rid="b")
    other_adapter = make([*system, 7, 8], adapter=f"{BASE_MODEL}:b", rid="c")
    worker.enqueue(second)
    worker.enqueue(other_adapter)
    run_to_end(worker)
    assert worker.stats.prompt_tokens == 67 + 66 + 66
    assert worker.stats.cached_tokens == 64  # b hits a's system prompt; c, another adapter, does not
    assert worker.outstanding == 0 and worker.stats.served == 3


def test_running_sequences_and_cached_prefixes_share_one_pool() -> None:
    """A long generation takes its blocks from the pool, evicting what the cache held; a request whose
    prompt does not fit waits for KV instead of failing, and is served once the generation ends."""
    model = replace(MODEL, kv_blocks=8)
    worker = PagedSimWorker("w0", model, BASE_MODEL)
    worker.enqueue(make(list(range(200, 280)), output=2, rid="cached"))  # 5 blocks, cached once done
    now = run_to_end(worker)
    assert worker.cached_run(make(list(range(200, 280))).block_hashes) == 5
    worker.enqueue(make([5] * 16, output=90, rid="long"))  # grows to 7 blocks over its generation
    for _ in range(61):  # 77 tokens: 5 blocks, from the 3 never used (one held cached's output) and 2 cached
        worker.start_step()
        worker.finish_step(now)
    # Freed tail first, so a prefix's leading blocks are evicted last.
    assert worker.cached_run(make(list(range(200, 280))).block_hashes) == 3
    worker.enqueue(make(list(range(300, 380)), output=2, rid="waits"))  # 5 blocks: only 3 are free
    worker.start_step()
    worker.finish_step(now)
    assert [s.request_id for s in worker.scheduler.waiting] == ["waits"] and worker.outstanding == 2
    run_to_end(worker, now)
    assert worker.stats.served == 3 and worker.outstanding == 0


def test_a_long_prompt_prefills_in_chunks_and_its_first_token_comes_with_the_last() -> None:
    worker = PagedSimWorker("w0", replace(MODEL, kv_blocks=256, max_prefill_tokens=512), BASE_MODEL)
    worker.enqueue(make(list(range(1000, 2200)), output=2))  # 1,200 tokens: chunks of 512, 512, 176
    durations: list[float] = []
    for _ in range(3):
        duration = worker.start_step()
        assert duration is not None
        durations.append(duration)
        first = [s.request.request_id for s in worker.admitted]
        worker.finish_step(sum(durations))
    assert durations == [pytest.approx(0.512), pytest.approx(0.512), pytest.approx(0.176)]
    assert first == ["r"] and worker.stats.ttft_s == [pytest.approx(1.2)]


def test_a_request_without_its_prompts_token_ids_is_refused() -> None:
    with pytest.raises(ValueError, match="token ids"):
        PagedSimWorker("w0", MODEL, BASE_MODEL).enqueue(SimRequest("r", "t", None, 0.0, 32, 3, (1, 2)))


@pytest.mark.parametrize("resident", ["device", "host", "disk"])
def test_adapter_loads_cost_what_the_tier_says(resident: str) -> None:
    worker = PagedSimWorker("w0", MODEL, BASE_MODEL)
    adapter = f"{BASE_MODEL}:a"
    if resident == "device":
        worker.tiers.device[adapter] = worker.tiers.host[adapter] = None
    elif resident == "host":
        worker.tiers.host[adapter] = None
    worker.enqueue(make(list(range(50)), adapter=adapter))
    load_s = {"device": 0.0, "host": MODEL.host_load_s, "disk": MODEL.disk_load_s}[resident]
    assert worker.start_step() == pytest.approx(load_s + 0.05)


def test_a_fleet_with_shared_kv_serves_every_request_once_on_the_paged_worker() -> None:
    fleet = FleetSpec(2, replace(EngineModel(), max_loras=4, host_adapters=8, shared_kv=True))
    spec = SimWorkloadSpec(num_requests=200, num_adapters=12, num_system_prompts=6, seed=4)
    requests = make_sim_workload(replace(spec, rate=default_rate(spec, fleet, 0.7)))
    result = simulate(requests, policy_profiles()("default"), fleet, seed=0, name="default")
    assert sum(result.served) == len(requests) and result.rejected == 0
    assert 0.0 < result.hit_rate < 1.0
    again = simulate(requests, policy_profiles()("default"), fleet, seed=0, name="default")
    assert again.hit_rate == result.hit_rate and again.ttft_s == result.ttft_s
