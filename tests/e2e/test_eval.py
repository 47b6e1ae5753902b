"""`loragate eval` end to end: a real gateway and a worker serving SmolLM2 with the shipped adapters.

The figures are the run's own: the test reads them from eval's last stdout line and checks them against
its table, and that some adapter beats the base model on its task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, running_stack
from worker.modelzoo.make import ZooPaths
from worker.modelzoo.train_adapters import SHIPPED_DIR

TASKS = "signoff,brackets,digits"
N = 4


def smol_stack(model: Path) -> type[Stack]:
    """A stack whose workers serve `model` as smollm2, with the shipped adapters."""

    class SmolStack(Stack):
        def start_worker(self, worker_id: str, base: str = "", metrics_port: int | None = None) -> None:
            self.workers[worker_id] = self._spawn(
                [
                    "worker",
                    *("--model", str(model), "--model-name", "smollm2", "--worker-id", worker_id),
                    *("--adapters", str(SHIPPED_DIR), "--kv-cache-mb", "256"),
                ],
                f"{worker_id}.log",
            )

    return SmolStack


def eval_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loragate.cli", "eval", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


@pytest.mark.slow
def test_eval_reports_base_and_adapter_accuracy_from_a_real_fleet(
    zoo: ZooPaths, smollm2: Path, redis_server: str, tmp_path: Path
) -> None:
    with running_stack(zoo, redis_server, tmp_path, workers=("w1",), stack_type=smol_stack(smollm2)) as stack:
        run = eval_cli(
            *("--base-url", f"{stack.url}/v1", "--api-key", "sk-test-alice"),
            *("--tasks", TASKS, "--n", str(N), "--concurrency", "8"),
        )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert set(report) >= {"tasks", "mean_gain"} and list(report["tasks"]) == TASKS.split(",")
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    for name, score in report["tasks"].items():
        assert score["n"] == N
        assert 0 <= score["base_accuracy"] <= 1 and 0 <= score["adapter_accuracy"] <= 1
        assert rows[name][:3] == [str(N), f"{score['base_accuracy']:.0%}", f"{score['adapter_accuracy']:.0%}"]
    gains = [s["adapter_accuracy"] - s["base_accuracy"] for s in report["tasks"].values()]
    assert max(gains) > 0
    assert report["mean_gain"] == pytest.approx(sum(gains) / len(gains))


def test_eval_without_a_fleet_says_how_to_start_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    run = eval_cli("--n", "1", env={**env, "LORAGATE_CACHE": str(tmp_path)})
    assert run.returncode == 1 and run.stdout == ""
    assert "no fleet to evaluate" in run.stderr and "loragate up" in run.stderr and "--base-url" in run.stderr


def test_eval_refuses_an_unknown_task(tmp_path: Path) -> None:
    run = eval_cli("--tasks", "upper,nope")
    assert run.returncode == 2 and "unknown task(s) nope; known tasks: upper" in run.stderr
