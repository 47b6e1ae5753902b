"""Fleet load test: one workload through a real N-worker stack once per routing profile, the simulator on
the same workload beside it (calibrated to the real workers), and the simulator's hundreds of workers.

The workload (`loadtest.sim_workload`): many tenants, adapters with Zipf popularity (the zoo's few `tiny`
checkpoints under many names), shared system prompts (each adapter's home prompt, Zipf), Poisson arrivals
with bursts. Per profile — `default`, `least-loaded`, `round-robin`, `prefix-only`, `adapter-only` — a
fresh real stack replays it open-loop (`loadtest.fleet_real`). The simulator then replays the same
requests on as many simulated workers, with the real workers' KV capacity, adapter slots and measured
speeds, so its prefix-hit rate and adapter loads can be checked against the real fleet's: a simulator
that predicts a 2-worker fleet is one to trust for 200 workers, where it runs next (the workload scaled
to the fleet), with a sweep of offered load for goodput.

Definitions: TTFT and ITL as the clients see them (after the first `--warmup` share of requests); prefix
hit rate = cached prompt tokens / prompt tokens (the responses' `cached_tokens`; the simulator's at
admission); adapter loads = adapters loaded onto the device (the workers' counter; the simulator's disk +
host loads), over the whole run; goodput = requests/s whose TTFT met `--slo-ms`.

`python -m loadtest.fleet [--out DIR]` writes DIR/report.html and PNG plots, and prints one JSON object as
its last line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtest.fleet_guidellm import guidellm_available
from loadtest.fleet_real import RealRun, adapter_links, fleet_policy, run_profile, run_tool
from loadtest.fleet_report import (
    FleetResults,
    ProfileFigures,
    SimFigures,
    real_figures,
    sim_figures,
    write_report,
)
from loadtest.sim_autoscale import ScalingRule, Timeline, autoscale, rate_steps
from loadtest.sim_report import ProfileResult
from loadtest.sim_worker import EngineModel
from loadtest.sim_workload import SimRequest, SimWorkloadSpec, make_sim_workload
from loadtest.simulate import FleetSpec, simulate
from policies.document import parse_policy
from worker.modelzoo.make import ensure_zoo

PROFILES = ("default", "least-loaded", "round-robin", "prefix-only", "adapter-only")
# Requests sized for the tiny model (its vocabulary) on CPUs: system prompts, user suffixes, outputs.
SHAPE = SimWorkloadSpec(system_len=(96, 320), suffix_len=(8, 48), output_len=(8, 48), vocab_size=8192)


def workload(args: argparse.Namespace, scale: int = 1) -> list[SimRequest]:
    """The workload: `scale` times the requests, rate, tenants, adapters and prompts of the real one."""
    spec = replace(
        SHAPE,
        num_requests=args.requests * scale,
        rate=args.rate * scale,
        num_adapters=args.adapters * scale,
        num_system_prompts=args.system_prompts * scale,
        num_tenants=8 * scale,
        seed=args.seed,
    )
    return with_bursts(make_sim_workload(spec), args.burst_every_s, args.burst_size)


def with_bursts(requests: list[SimRequest], every_s: float, size: int) -> list[SimRequest]:
    """Every `every_s`, the `size` requests that follow arrive at once (a synchronized burst)."""
    if every_s <= 0 or size <= 1:
        return requests
    out, k = list(requests), 0
    while k < len(out):
        at = out[k].arrival_s
        for j in range(k, min(k + size, len(out))):
            out[j] = replace(out[j], arrival_s=at)
        k += size
        while k < len(out) and out[k].arrival_s < at + every_s:
            k += 1
    return out


def calibrated(real: RealRun, args: argparse.Namespace) -> EngineModel:
    """The simulated worker: the real one's KV blocks and adapter slots, its measured decode step and
    prefill speed (in the run of the first profile)."""
    itl = sorted(g for s in real.stats for g in s.itl_s)
    # Prefill speed: uncached prompt tokens / TTFT, whose queueing only lowers it: its 90th percentile (the
    # requests that found their worker free), measured under the run's own CPU contention.
    speeds = sorted(
        (s.prompt_tokens - s.cached_tokens) / s.ttft_s
        for s in real.stats
        if s.error is None and s.ttft_s and s.prompt_tokens > s.cached_tokens
    )
    return replace(
        EngineModel(),
        cache_blocks=real.kv_blocks,
        kv_blocks=real.kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=2048,
        max_loras=real.max_loras,
        host_adapters=max(real.max_loras, args.adapters),  # every adapter fits the real host tier
        decode_step_s=itl[len(itl) // 2] if itl else EngineModel().decode_step_s,
        decode_step_per_seq_s=0.0,
        shared_kv=True,
        prefill_tok_s=speeds[int(0.9 * (len(speeds) - 1))] if speeds else args.sim_prefill_tok_s,
    )


def rounds(names: Sequence[str], repeats: int) -> list[str]:
    """The profile runs in order: `repeats` rounds of every profile, every other round reversed (A B C, C B
    A: over a pair of rounds each profile's mean position is the same), each pair rotated by one."""
    order: list[str] = []
    for r in range(repeats):
        k = (r // 2) % len(names)
        turn = [*names[k:], *names[:k]]
        order += turn[::-1] if r % 2 else turn
    return order


def pooled(runs: Sequence[RealRun]) -> RealRun:
    """One run's view of several (their requests' stats together), for calibrating the simulator."""
    return replace(runs[0], stats=[s for run in runs for s in run.stats])


def sim_profiles(
    requests: list[SimRequest],
    workers: int,
    engine: EngineModel,
    names: Sequence[str],
    warmup: int,
    seeds: Sequence[int],
) -> dict[str, list[ProfileResult]]:
    """Each profile simulated once per seed (the routing's random tie-breaks, as a real gateway's)."""
    fleet = FleetSpec(workers, engine)
    return {
        n: [simulate(requests, parse_policy(fleet_policy(n)).profile(n), fleet, s, n, warmup) for s in seeds]
        for n in names
    }


def goodput_sweep(
    args: argparse.Namespace, engine: EngineModel, names: Sequence[str], loads: Sequence[float]
) -> dict[str, list[tuple[float, float]]]:
    """Simulated goodput (requests/s within the SLO) against offered load (requests/s), per profile."""
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for factor in tqdm(loads, desc="goodput sweep (simulated)", unit="load"):
        swept = argparse.Namespace(**{**vars(args), "rate": args.rate * factor})
        requests = workload(swept)
        span = requests[-1].arrival_s - requests[0].arrival_s
        for name, (result,) in sim_profiles(requests, args.workers, engine, names, 0, [args.seed]).items():
            good = sum(1 for t in result.ttft_s if t * 1000 <= args.slo_ms)
            out[name].append((len(requests) / span, good / max(span, result.sim_s)))
    return out


def outside_tool(
    args: argparse.Namespace, requests: list[SimRequest], url: str, work: Path, profile: str
) -> dict[str, Any]:
    """guidellm against the stack at `url` (the last profile run's, after that run) with `profile`, at the
    same rate, as many requests of the workload's mean prompt and output lengths (its own synthetic
    prompts: no shared prefixes, no adapters)."""
    prompt = round(sum(r.prompt_tokens for r in requests) / len(requests))
    output = round(sum(r.output_tokens for r in requests) / len(requests))
    try:
        figures = run_tool(
            url, profile, ensure_zoo().base("tiny"), args.rate, len(requests), prompt, output, work
        )
    except RuntimeError as e:  # guidellm failed or served nothing: the report says so, the run goes on
        return {"profile": profile, "error": str(e)[-500:]}
    return {"profile": profile, "prompt_tokens": prompt, "output_tokens": output, **figures}


def autoscaling(args: argparse.Namespace, engine: EngineModel) -> tuple[dict[str, Any], Timeline]:
    """The default profile on an autoscaled simulated fleet (KEDA's rule, `loadtest.sim_autoscale`),
    from zero workers: a quiet minute, a two-minute surge to `sim_workers / 4` workers' worth of load
    (70 % of what a calibrated worker saturates at, each), a quiet minute, then nothing."""
    peak = max(2, args.sim_workers // 4)
    per_worker = 0.7 * engine.saturation_rps(SHAPE.mean_prompt_tokens, SHAPE.mean_output_tokens)
    steps = [(60.0, per_worker), (120.0, per_worker * peak), (60.0, per_worker), (180.0, 0.0)]
    count = int(sum(d * r for d, r in steps) * 1.5) + 10
    pool = workload(
        argparse.Namespace(**{**vars(args), "requests": count}), scale=max(1, peak // args.workers)
    )
    requests = rate_steps(pool, steps, args.seed)
    rule = ScalingRule(target=8.0, max_workers=peak * 2, poll_s=2.0, cold_start_s=20.0, cooldown_s=60.0)
    fleet_spec = FleetSpec(rule.max_workers, engine)
    profile = parse_policy(fleet_policy("default")).profile("default")
    result, timeline = autoscale(requests, profile, fleet_spec, rule, sum(d for d, _ in steps), args.seed)
    live = [p[1] for p in timeline.points]
    surge_at, top = steps[0][0], max(live, default=0)
    ready = next((p[0] for p in timeline.points if p[0] >= surge_at and p[1] >= 0.9 * top), None)
    figures = {
        "requests": len(requests),
        "peak_workers": top,
        "scale_up_s": round(ready - surge_at, 1) if ready is not None else None,
        "ttft_p50_ms": round(1000 * result.ttft_quantile(0.5), 1),
        "ttft_p99_ms": round(1000 * result.ttft_quantile(0.99), 1),
        "workers_at_end": live[-1] if live else 0,
        "rule": asdict(rule),
    }
    return figures, timeline


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m loadtest.fleet", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", default="loadtest_out/fleet", help="report directory")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--rate", type=float, default=3.0, help="requests/s offered to the real fleet")
    p.add_argument("--adapters", type=int, default=24)
    p.add_argument("--system-prompts", type=int, default=6)
    p.add_argument("--burst-every-s", type=float, default=10.0, help="a burst this often (0: none)")
    p.add_argument("--burst-size", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=4, help="each real worker's device adapter slots")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-mb", type=int, default=8, help="each real worker's KV cache")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--warmup", type=float, default=0.2, help="share of requests not in the latency figures")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT objective for goodput")
    p.add_argument("--sim-workers", type=int, default=200, help="the simulated fleet at scale")
    p.add_argument("--sim-prefill-tok-s", type=float, default=6000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sim-seeds",
        type=int,
        default=4,
        help="simulated runs of the real fleet's size per profile (tie-break seeds from --seed), pooled",
    )
    p.add_argument("--no-guidellm", action="store_true", help="skip the guidellm run beside ours")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs per profile, in rounds whose order rotates (no profile always first); figures pooled",
    )
    p.add_argument(
        "--warm-requests",
        type=int,
        default=24,
        help="an unmeasured run of this many requests first, so no profile meets a cold machine (0: none)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.profiles.split(",") if n]
    zoo = ensure_zoo()
    requests = workload(args)
    warmup = int(args.warmup * len(requests))
    links = adapter_links(args.adapters, sorted((zoo.root / "adapters" / "tiny").iterdir()))
    flags = ["--max-loras", str(args.max_loras), "--max-num-seqs", str(args.max_num_seqs)]
    flags += ["--kv-cache-mb", str(args.kv_cache_mb)]
    runs: dict[str, list[RealRun]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="lg-fleet-") as tmp:
        if args.warm_requests:
            head = requests[: args.warm_requests]
            run_profile(names[0], head, Path(tmp) / "warm", zoo.base("tiny"), links, args.workers, flags)
        order = rounds(names, args.repeats)
        tool: dict[str, Any] = {
            "skipped": "--no-guidellm" if args.no_guidellm else "guidellm is not installed"
        }
        wanted = not args.no_guidellm and guidellm_available()

        def guidellm(url: str) -> None:  # on the last run's stack, once that run is done
            tool.clear()
            tool.update(outside_tool(args, requests, url, Path(tmp) / "guidellm", names[0]))

        for i, name in enumerate(tqdm(order, desc="real fleet, profile runs", unit="run")):
            work = Path(tmp) / f"{name}-{i}"
            then = guidellm if wanted and i == len(order) - 1 else None
            runs[name].append(
                run_profile(name, requests, work, zoo.base("tiny"), links, args.workers, flags, then=then)
            )
    real = {n: runs[n][0] for n in names}  # the plots over time (queue depth) show each profile's first run
    engine = calibrated(pooled(runs[names[0]]), args)
    sim = sim_profiles(requests, args.workers, engine, names, 0, range(args.seed, args.seed + args.sim_seeds))
    scale = max(1, args.sim_workers // args.workers)
    at_scale = sim_profiles(
        workload(args, scale),
        args.sim_workers,
        engine,
        names,
        int(args.warmup * args.requests * scale),
        [args.seed],
    )
    sweep = goodput_sweep(args, engine, names, (0.5, 1.0, 1.5, 2.0, 3.0, 4.0))
    scaling, timeline = autoscaling(args, engine)
    figures: dict[str, ProfileFigures] = {
        n: real_figures(runs[n], requests, warmup, args.slo_ms) for n in names
    }
    sims: dict[str, SimFigures] = {n: sim_figures(sim[n]) for n in names}
    scaled: dict[str, SimFigures] = {n: sim_figures(at_scale[n]) for n in names}
    results = FleetResults(figures, sims, scaled, sweep, real, timeline)
    summary = write_report(
        out, args, results, {"autoscaling": scaling, "guidellm": tool, "sim_engine": asdict(engine)}
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
