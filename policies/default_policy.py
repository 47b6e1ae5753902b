"""The policy every deployment starts with (`loragate policy default` prints it as YAML).

Profiles: `default` (prefix + adapter + load + cost scorers, argmax), `least-loaded` (load only),
`round-robin` and `random` (baselines for benchmarks); the alias `auto` sends requests with difficulty
≤ 0.4 to the toy `tiny` model and the rest to the real `smollm2`, shifting to `tiny` when `smollm2`'s pool
is over 85% busy (the rungs of `loragate up`'s default stack and of compose.yaml; a rung without workers
passes its requests to the nearest rung that has some).
Treat `DEFAULT_POLICY` as read-only: `copy.deepcopy` it to derive another document.
"""

from __future__ import annotations

from typing import Any, Final


def _admission() -> list[dict[str, Any]]:
    """The filters every profile shares (fresh dicts, so a YAML dump has no anchors)."""
    return [{"ref": r} for r in ("serves-model", "not-draining", "healthy", "tenant-allowed", "queue-bound")]


DEFAULT_POLICY: Final[dict[str, Any]] = {
    "description": "loragate default: prefix-, adapter- and load-aware routing with TTFT prediction",
    "default_profile": "default",
    "plugins": [
        {"type": "serves-model", "name": "serves-model"},
        {"type": "not-draining", "name": "not-draining"},
        {"type": "healthy", "name": "healthy", "parameters": {"max_age_s": 5}},
        {"type": "tenant-allowed", "name": "tenant-allowed"},
        {"type": "queue-bound", "name": "queue-bound", "parameters": {"max_outstanding": 256}},
        {
            "type": "kv-room",
            "name": "kv-room",
            "parameters": {"headroom_tokens": 16, "max_tokens_fraction": 0.25},
        },
        {"type": "prefix", "name": "prefix"},
        {
            "type": "adapter",
            "name": "adapter",
            "parameters": {"device_s": 0.0, "host_s": 0.005, "disk_s": 0.05, "scale_s": 0.01},
        },
        {"type": "load", "name": "load", "parameters": {"capacity": 32, "max_running": 64}},
        {
            "type": "cost",
            "name": "cost",
            "parameters": {
                "device_s": 0.0,
                "host_s": 0.005,
                "disk_s": 0.05,
                "request_s": 0.02,
                "default_prefill_tok_s": 4000,
                "floor_s": 0.05,
            },
        },
        {"type": "difficulty", "name": "difficulty"},
        {"type": "max", "name": "max"},
        {"type": "round-robin", "name": "round-robin"},
        {"type": "random", "name": "random"},
    ],
    "profiles": [
        {
            "name": "default",
            "plugins": [
                *_admission(),
                {"ref": "kv-room"},
                {"ref": "prefix", "weight": 3},
                {"ref": "adapter", "weight": 2},
                {"ref": "load", "weight": 2},
                {"ref": "cost", "weight": 6},
                {"ref": "difficulty", "weight": 1},
                {"ref": "max"},
            ],
        },
        {"name": "least-loaded", "plugins": [*_admission(), {"ref": "load"}, {"ref": "max"}]},
        {"name": "round-robin", "plugins": [*_admission(), {"ref": "round-robin"}]},
        {"name": "random", "plugins": [*_admission(), {"ref": "random"}]},
    ],
    "aliases": {
        "auto": {
            "rungs": [{"max_score": 0.4, "model": "tiny"}, {"model": "smollm2"}],
            "saturation_threshold": 0.85,
            "profile": "default",
        }
    },
    "difficulty": {"estimator": "heuristic"},
}
