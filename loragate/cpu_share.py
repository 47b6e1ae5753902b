"""How many CPU threads each of several CPU workers on one machine gets.

A worker's engine runs its matrix products on torch's intra-op thread pool (OpenMP), which by default
takes every core. Two such workers on one machine then run twice as many threads as cores, and OpenMP's
threads spin at their barriers: each step of each worker waits on threads the other one holds, and both
slow down several-fold (measured: the fleet load test's two workers on 2 cores had ~2x the inter-token
latency when the router spread load over both than when it kept it on one). So a stack that starts
several CPU workers on one machine (`loragate up`, the load tests' stacks) gives each its share of the
cores it may use (`loragate worker --threads`), at least one.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (not Linux)
        return max(1, os.cpu_count() or 1)


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Each of `workers` CPU workers' share of `cores` (default: `usable_cores()`), at least 1."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return max(1, (cores if cores is not None else usable_cores()) // workers)
