"""The routing simulator's results: per-profile figures, the comparison table, the JSON summary, a chart.

The summary's ratios are the `default` profile's against the single-worker oracle (prefix hit rate; the
Belady bound is reported beside it) and the `round-robin` and `least-loaded` baselines;
`max_load_vs_mean` is requests served per worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ProfileResult:
    name: str
    prompt_tokens: int
    cached_tokens: int
    disk_loads: int
    host_loads: int
    ttft_s: list[float]
    served: list[int]  # requests per worker
    tokens: list[int]  # prompt + output tokens per worker
    rejected: int
    sim_s: float
    mean_batch: float
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def adapter_loads(self) -> int:
        return self.disk_loads + self.host_loads

    def ttft_quantile(self, q: float) -> float:
        """Nearest-rank quantile of the TTFTs, in seconds."""
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] if ordered else 0.0

    @property
    def max_load_vs_mean(self) -> float:
        mean = sum(self.served) / len(self.served)
        return max(self.served) / mean if mean else 0.0

    def summary(self) -> dict[str, Any]:
        mean_tokens = sum(self.tokens) / len(self.tokens)
        return {
            "prefix_hit_rate": round(self.hit_rate, 4),
            "adapter_loads": self.adapter_loads,
            "disk_loads": self.disk_loads,
            "host_loads": self.host_loads,
            "ttft_p50_ms": round(1000 * self.ttft_quantile(0.50), 1),
            "ttft_p99_ms": round(1000 * self.ttft_quantile(0.99), 1),
            "max_load_vs_mean": round(self.max_load_vs_mean, 3),
            "max_tokens_vs_mean": round(max(self.tokens) / mean_tokens, 3) if mean_tokens else 0.0,
            "served_per_worker": self.served,
            "rejected": self.rejected,
            "mean_batch": round(self.mean_batch, 1),
            "sim_s": round(self.sim_s, 1),
            "wall_s": round(self.wall_s, 2),
        }


@dataclass(frozen=True, slots=True)
class Oracles:
    """Hit rates of one worker with the fleet's whole cache (`loadtest.sim_oracle`)."""

    single_worker: float  # LRU, as the workers evict: the oracle routing is measured against
    bound: float  # Belady: no placement and no eviction policy can beat it


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("inf")


def report(results: Mapping[str, ProfileResult], oracles: Oracles, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON summary: the `default` profile's ratios against the oracle and the baselines."""
    out: dict[str, Any] = dict(meta)
    full = results.get("default")
    if full is not None:
        p99 = full.ttft_quantile(0.99)
        out["prefix_hit_vs_oracle"] = ratio(full.hit_rate, oracles.single_worker)
        out["prefix_hit_vs_bound"] = ratio(full.hit_rate, oracles.bound)
        if "round-robin" in results:
            rr = results["round-robin"]
            out["adapter_loads_vs_round_robin"] = ratio(full.adapter_loads, rr.adapter_loads)
            out["p99_ttft_vs_round_robin"] = ratio(p99, rr.ttft_quantile(0.99))
        if "least-loaded" in results:
            out["p99_ttft_vs_least_loaded"] = ratio(p99, results["least-loaded"].ttft_quantile(0.99))
        out["max_load_vs_mean"] = round(full.max_load_vs_mean, 3)
    out["oracle_prefix_hit_rate"] = round(oracles.single_worker, 4)
    out["bound_prefix_hit_rate"] = round(oracles.bound, 4)
    out["profiles"] = {name: r.summary() for name, r in results.items()}
    return out


def table(results: Mapping[str, ProfileResult], oracles: Oracles) -> str:
    head = (
        f"{'profile':<16}{'hit rate':>9}{'vs oracle':>10}{'loads':>7}{'disk':>6}{'host':>6}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'max/mean':>9}{'batch':>7}{'wall s':>8}"
    )
    lines = [head, "-" * len(head)]
    refs = (("bound (Belady)", oracles.bound), ("oracle (1 wkr)", oracles.single_worker))
    lines += [f"{name:<16}{rate:>9.3f}{ratio(rate, oracles.single_worker):>10.3f}" for name, rate in refs]
    for name, r in results.items():
        lines.append(
            f"{name:<16}{r.hit_rate:>9.3f}{ratio(r.hit_rate, oracles.single_worker):>10.3f}"
            f"{r.adapter_loads:>7}{r.disk_loads:>6}{r.host_loads:>6}"
            f"{1000 * r.ttft_quantile(0.5):>8.1f}{1000 * r.ttft_quantile(0.99):>8.1f}"
            f"{r.max_load_vs_mean:>9.3f}{r.mean_batch:>7.1f}{r.wall_s:>8.2f}"
        )
    return "\n".join(lines)


def plot(results: Mapping[str, ProfileResult], oracles: Oracles, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    panels = [
        ("prefix hit rate", [results[n].hit_rate for n in names], oracles.single_worker),
        ("adapter loads", [float(results[n].adapter_loads) for n in names], None),
        ("p99 TTFT (ms)", [1000 * results[n].ttft_quantile(0.99) for n in names], None),
        ("max / mean load", [results[n].max_load_vs_mean for n in names], 1.5),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, values, line) in zip(axes, panels, strict=True):
        ax.bar(names, values, color="tab:blue")
        if line is not None:
            ax.axhline(line, color="tab:red", linestyle="--", linewidth=1)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
