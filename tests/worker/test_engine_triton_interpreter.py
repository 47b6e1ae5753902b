"""The whole engine on the Triton kernels gives the same tokens as on the torch kernels: the GPU path,
proven on a CPU through the Triton interpreter, its whole-decode steps through the decode graphs' static
buffers (`worker.decode_graphs`, uncaptured off a GPU) and its other steps eagerly.

`TRITON_INTERPRET=1` only takes effect if it is set before triton is first imported, which has happened
in any pytest process (see tests/kernels/conftest.py), so the Triton side runs `tests.worker.engine_scenario`
in child processes with the interpreter on and `LORAGATE_KERNEL_BACKEND=triton`, which print their tokens
as JSON; the torch side runs the same scenario here, meanwhile. The scenario's two parts run in two
children at once: the interpreter is one core's Python, and the whole scenario in one child took 65 s
on a 2.8 GHz Ice Lake core (imports included; interpreted steps of 1.2-6.5 s).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401  # a pinned dependency: a broken install fails here, it does not skip

from kernels.backend import BACKEND_ENV
from tests.children import outputs, started
from tests.worker.engine_scenario import PARTS, merged, run_scenario
from worker.modelzoo.make import ZooPaths

ROOT = Path(__file__).resolve().parents[2]
# Generous for two busy cores; a hung interpreter fails the test instead of the suite.
CHILD_TIMEOUT_S = 240


@pytest.mark.slow
def test_engine_on_triton_kernels_matches_the_torch_kernels(
    zoo: ZooPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", BACKEND_ENV: "triton"}
    argv = [sys.executable, "-m", "tests.worker.engine_scenario", str(zoo.root), "--graphs", "--part"]
    with started([([*argv, part], env) for part in PARTS], ROOT) as children:
        monkeypatch.setenv(BACKEND_ENV, "torch")
        expected = merged([run_scenario(zoo, part) for part in PARTS])  # meanwhile, on the torch kernels
        results = outputs(children, CHILD_TIMEOUT_S)
    for child, (_, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err[-4000:]
    got = merged([json.loads(out.strip().splitlines()[-1]) for out, _ in results])
    assert got["triton_modules"] == [
        "kernels.attention_decode_triton",
        "kernels.attention_prefill_triton",
        "kernels.sgmv_group_triton",
    ]
    assert expected["cached"]["b0"] == 16, "the scenario's second round must hit the prefix cache"
    assert got["cached"] == expected["cached"]
    assert got["tokens"] == expected["tokens"]
    # The whole-decode steps ran on the decode graphs' static buffers (padded to their buckets, the pad
    # rows' KV in the spare block), the prefill and mixed steps eagerly: both gave the torch kernels' tokens.
    assert expected["graph_steps"] == 0
    assert 0 < got["graph_steps"] < got["steps"] == expected["steps"]
