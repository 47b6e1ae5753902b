"""Runs the Triton kernel tests (`test_*_triton.py`) under the Triton interpreter in child pytests.

See `conftest.py` for why they need processes of their own. The interpreter is one core's Python, so the
tests are split into interleaved shards, one child each, all at once; the children load no third-party
pytest plugins (langsmith's, faker's, schemathesis's ... took ~7 s of each child's start), only the
per-test timeout.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401  # a pinned dependency: a broken install fails here, it does not skip

from kernels.backend import BACKEND_ENV, triton_interpreting
from tests.children import outputs, started
from tests.kernels.kernel_testing import INTERPRETER_TESTS, SHARD_ENV

# The children take ~25 s on two busy cores; a hung interpreter fails the test instead of the suite.
CHILD_TIMEOUT_S = 180
SHARDS = 2
OUTCOMES = re.compile(r"(\d+) (passed|deselected|failed|errors?|skipped)")


@pytest.mark.skipif(triton_interpreting(), reason="this process already collects the Triton tests itself")
def test_triton_kernels_match_references_under_the_interpreter() -> None:
    here = Path(__file__).parent
    files = sorted(str(p.relative_to(here.parent.parent)) for p in here.glob(INTERPRETER_TESTS))
    assert files, f"no {INTERPRETER_TESTS} next to {here}"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop(BACKEND_ENV, None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout", *files]
    shards = [(command, {**env, SHARD_ENV: f"{i}/{SHARDS}"}) for i in range(SHARDS)]
    with started(shards, here.parent.parent) as children:
        results = outputs(children, CHILD_TIMEOUT_S)
    counts = []
    for child, (out, err) in zip(children, results, strict=True):
        assert child.returncode == 0, out[-8000:] + err[-2000:]
        counts.append({kind: int(n) for n, kind in OUTCOMES.findall(out.strip().splitlines()[-1])})
    # Every shard saw the same tests, ran its own share of them, and together they ran them all.
    ran = [c.get("passed", 0) + c.get("skipped", 0) for c in counts]
    totals = {n + c.get("deselected", 0) for n, c in zip(ran, counts, strict=True)}
    assert len(totals) == 1 and all(c.get("passed", 0) > 0 for c in counts), counts
    assert sum(ran) == totals.pop(), counts
