"""The fleet load test's figures, plots (PNG) and report (HTML + the JSON summary): `loadtest.fleet`."""

from __future__ import annotations

import argparse
import html
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loadtest.fleet_real import RealRun
from loadtest.procs import pct
from loadtest.sim_autoscale import Timeline
from loadtest.sim_report import ProfileResult
from loadtest.sim_workload import SimRequest

BASELINES = ("least-loaded", "round-robin", "prefix-only", "adapter-only")
SIM_TOLERANCE = 0.10  # the simulator must predict the real fleet's prefix hits and adapter loads this well


@dataclass
class ProfileFigures:
    """A real run's figures."""

    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    prefix_hit_rate: float
    adapter_loads: int
    goodput_rps: float
    offered_rps: float
    served_per_worker: list[int]
    ttft_ms: list[float]
    itl_ms: list[float]


@dataclass
class SimFigures:
    prefix_hit_rate: float
    adapter_loads: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    served_per_worker: list[int]
    runs: int = 1


def real_figures(
    runs: RealRun | Sequence[RealRun], requests: list[SimRequest], warmup: int, slo_ms: float
) -> ProfileFigures:
    """One profile's figures over its runs (repeats of the same workload): latencies pooled over every
    run's measured requests, prefix hits over all their prompt tokens, adapter loads and goodput per run
    (their mean)."""
    runs = [runs] if isinstance(runs, RealRun) else list(runs)
    stats = [s for run in runs for s in run.stats]
    ok = [s for s in stats if s.error is None]
    measured = [s for run in runs for s in run.stats[warmup:] if s.error is None and s.ttft_s is not None]
    ttft = [1000 * s.ttft_s for s in measured if s.ttft_s is not None]
    itl = [1000 * g for s in measured for g in s.itl_s]
    prompt = sum(s.prompt_tokens for s in ok)
    served = [served_per_worker(run) for run in runs]  # per run, workers in name order: their mean
    span = requests[-1].arrival_s - requests[warmup].arrival_s if len(requests) > warmup + 1 else 1.0
    loads = [run.counters.get("adapter_loads_host", 0) for run in runs]  # device loads (from host or disk)
    return ProfileFigures(
        requests=len(stats),
        errors=len(stats) - len(ok),
        ttft_p50_ms=round(pct(ttft, 50), 1),
        ttft_p99_ms=round(pct(ttft, 99), 1),
        itl_p50_ms=round(pct(itl, 50), 1),
        itl_p99_ms=round(pct(itl, 99), 1),
        prefix_hit_rate=round(sum(s.cached_tokens for s in ok) / prompt, 4) if prompt else 0.0,
        adapter_loads=round(sum(loads) / len(loads)),
        goodput_rps=round(sum(1 for t in ttft if t <= slo_ms) / span / len(runs), 3),
        offered_rps=round((len(requests) - warmup) / span, 3),
        served_per_worker=[round(sum(c) / len(runs)) for c in zip(*served, strict=False)],
        ttft_ms=ttft,
        itl_ms=itl,
    )


def served_per_worker(run: RealRun) -> list[int]:
    workers = Counter(s.worker for s in run.stats if s.error is None)
    return [n for _, n in sorted(workers.items(), key=lambda kv: str(kv[0]))]


def sim_figures(results: ProfileResult | Sequence[ProfileResult]) -> SimFigures:
    """One profile's simulated figures over its runs (tie-breaking seeds), pooled as `real_figures` pools
    the real repeats: prefix hits over all their prompt tokens, adapter loads per run (their mean), TTFTs
    together."""
    runs = [results] if isinstance(results, ProfileResult) else list(results)
    prompt = sum(r.prompt_tokens for r in runs)
    pooled = replace(runs[0], ttft_s=[t for r in runs for t in r.ttft_s])
    return SimFigures(
        prefix_hit_rate=round(sum(r.cached_tokens for r in runs) / prompt, 4) if prompt else 0.0,
        adapter_loads=round(sum(r.adapter_loads for r in runs) / len(runs)),
        ttft_p50_ms=round(1000 * pooled.ttft_quantile(0.5), 1),
        ttft_p99_ms=round(1000 * pooled.ttft_quantile(0.99), 1),
        served_per_worker=[round(sum(c) / len(runs)) for c in zip(*(r.served for r in runs), strict=True)],
        runs=len(runs),
    )


def _rel(sim: float, real: float) -> float:
    """The simulator's error relative to the real figure (0 when both are 0)."""
    return round(abs(sim - real) / real, 4) if real else (0.0 if sim == 0 else 1.0)


def summary(
    args: argparse.Namespace,
    real: Mapping[str, ProfileFigures],
    sim: Mapping[str, SimFigures],
    scaled: Mapping[str, SimFigures],
) -> dict[str, Any]:
    profiles: dict[str, Any] = {}
    for name, r in real.items():
        s = sim[name]
        fields = {k: v for k, v in asdict(r).items() if k not in ("ttft_ms", "itl_ms")}
        profiles[name] = {
            **fields,
            "sim": asdict(s),
            "sim_prefix_hit_error": _rel(s.prefix_hit_rate, r.prefix_hit_rate),
            "sim_adapter_loads_error": _rel(s.adapter_loads, r.adapter_loads),
            "at_scale": asdict(scaled[name]),
        }
    out: dict[str, Any] = {
        "workers": args.workers,
        "requests": args.requests,
        "rate": args.rate,
        "adapters": args.adapters,
        "sim_workers": args.sim_workers,
        "slo_ms": args.slo_ms,
        "profiles": profiles,
    }
    if "default" in real:
        p99 = real["default"].ttft_p99_ms
        others = {n: real[n].ttft_p99_ms for n in BASELINES if n in real}
        out["default_ttft_p99_ms"] = p99
        out["default_p99_below_every_baseline"] = all(p99 < v for v in others.values())
    errors = [e for p in profiles.values() for e in (p["sim_prefix_hit_error"], p["sim_adapter_loads_error"])]
    out["sim_max_error"] = max(errors) if errors else None
    out["sim_within_10pct"] = bool(errors) and max(errors) <= SIM_TOLERANCE
    return out


@dataclass
class FleetResults:
    """Everything a fleet run measured: per profile, the real figures, the simulator's on the same
    requests and at scale, the simulated goodput sweep and the real runs; the autoscaling timeline."""

    real: Mapping[str, ProfileFigures]
    sim: Mapping[str, SimFigures]
    scaled: Mapping[str, SimFigures]
    sweep: Mapping[str, list[tuple[float, float]]]
    runs: Mapping[str, RealRun]
    timeline: Timeline


def _plots(out: Path, results: FleetResults) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real, sim, scaled, sweep, runs, timeline = (
        results.real,
        results.sim,
        results.scaled,
        results.sweep,
        results.runs,
        results.timeline,
    )
    names, paths = list(real), []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(name)

    for key, title, name in (
        ("ttft_ms", "TTFT", "ttft_cdf.png"),
        ("itl_ms", "inter-token latency", "itl_cdf.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in names:
            values = sorted(getattr(real[n], key))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=n)
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms, log)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{title} CDF, real fleet")
        ax.legend()
        save(fig, name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        xs, ys = zip(*sweep[n], strict=True) if sweep.get(n) else ((), ())
        line = ax.plot(xs, ys, marker="o", label=f"{n} (sim)")[0]
        ax.scatter([real[n].offered_rps], [real[n].goodput_rps], marker="*", s=120, color=line.get_color())
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.set_title("goodput vs offered load (lines: simulated; stars: real)")
    ax.legend(fontsize=8)
    save(fig, "goodput.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.4
    for ax, attr, title in (
        (axes[0], "prefix_hit_rate", "prefix hit rate"),
        (axes[1], "adapter_loads", "adapter loads"),
    ):
        pos = range(len(names))
        ax.bar([x - width / 2 for x in pos], [getattr(real[n], attr) for n in names], width, label="real")
        ax.bar([x + width / 2 for x in pos], [getattr(sim[n], attr) for n in names], width, label="simulated")
        ax.set_xticks(list(pos), names, rotation=30)
        ax.set_title(f"{title}: real vs simulated")
        ax.legend()
    save(fig, "sim_vs_real.png")

    fig, axes = plt.subplots(len(names), 1, figsize=(7, 1.8 * len(names)), sharex=True, squeeze=False)
    for ax, n in zip(axes[:, 0], names, strict=True):
        depth = runs[n].queue_depth
        if depth:
            t = [d[0] for d in depth]
            for w in range(max(len(d[1]) for d in depth)):
                ax.plot(t, [d[1][w] if w < len(d[1]) else 0 for d in depth], label=f"worker {w}")
        ax.set_ylabel(n, fontsize=8)
    axes[0, 0].set_title("queue depth per worker over time (real fleet)")
    axes[-1, 0].set_xlabel("s")
    save(fig, "queue_depth.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [scaled[n].prefix_hit_rate for n in names])
    axes[0].set_title("prefix hit rate at scale (simulated)")
    axes[1].bar(names, [scaled[n].ttft_p99_ms for n in names])
    axes[1].set_title("p99 TTFT at scale (simulated, ms)")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30)
    save(fig, "at_scale.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    t = [p[0] for p in timeline.points]
    ax.step(t, [p[1] for p in timeline.points], where="post", label="live workers")
    ax.step(t, [p[1] + p[2] for p in timeline.points], where="post", linestyle="--", label="live + starting")
    ax.set_ylabel("workers")
    twin = ax.twinx()
    twin.plot(t, [p[3] for p in timeline.points], color="tab:gray", alpha=0.6, label="demand (requests)")
    twin.plot(t, [p[4] for p in timeline.points], color="tab:red", alpha=0.6, label="waiting for a worker")
    twin.set_ylabel("requests")
    ax.set_xlabel("s")
    ax.set_title("autoscaling reaction (simulated, KEDA rule, from zero)")
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    save(fig, "autoscaling.png")
    return paths


def write_report(
    out: Path, args: argparse.Namespace, results: FleetResults, extra: Mapping[str, Any]
) -> dict[str, Any]:
    result = summary(args, results.real, results.sim, results.scaled) | dict(extra)
    result["plots"] = [str(out / p) for p in _plots(out, results)]
    cols = [
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "goodput_rps",
        "prefix_hit_rate",
        "adapter_loads",
        "errors",
    ]
    rows = []
    for name, p in result["profiles"].items():
        cells = "".join(f"<td>{p[c]}</td>" for c in cols)
        sim_cells = f"<td>{p['sim']['prefix_hit_rate']}</td><td>{p['sim']['adapter_loads']}</td>"
        scale_cells = f"<td>{p['at_scale']['prefix_hit_rate']}</td><td>{p['at_scale']['ttft_p99_ms']}</td>"
        rows.append(f"<tr><th>{html.escape(name)}</th>{cells}{sim_cells}{scale_cells}</tr>")
    head = "".join(
        f"<th>{c}</th>" for c in ["profile", *cols, "sim hit", "sim loads", "scale hit", "scale p99"]
    )
    tool = result.get("guidellm") or {}
    if "ttft_p50_ms" in tool and tool.get("profile") in result["profiles"]:
        ours = result["profiles"][tool["profile"]]
        keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")
        rows.append(
            f"<tr><th>guidellm ({html.escape(tool['profile'])}, synthetic)</th>"
            + "".join(f"<td>{tool[k]:.1f}</td>" for k in keys)
            + f"<td colspan=8>ours: {', '.join(f'{k} {ours[k]}' for k in keys)}</td></tr>"
        )
    images = "".join(f'<p><img src="{Path(p).name}"></p>' for p in result["plots"])
    text = (
        "<!doctype html><meta charset=utf-8><title>loragate fleet load test</title>"
        "<style>body{font-family:sans-serif}td,th{padding:3px 8px;text-align:right}</style>"
        f"<h1>loragate fleet load test</h1><p>{args.workers} real workers, {args.requests} requests at "
        f"{args.rate}/s, {args.adapters} adapters; simulator at {args.sim_workers} workers.</p>"
        f"<table><tr>{head}</tr>{''.join(rows)}</table>"
        f"<pre>{html.escape(str({k: v for k, v in result.items() if k != 'profiles'}))}</pre>{images}"
    )
    (out / "report.html").write_text(text)
    result["report"] = str(out / "report.html")
    return result
