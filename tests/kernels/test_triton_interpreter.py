"""Runs the Triton kernel tests (`test_*_triton.py`) under the Triton interpreter in a child pytest.

See `conftest.py` for why they need a process of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401  # a pinned dependency: a broken install fails here, it does not skip

from kernels.backend import BACKEND_ENV, triton_interpreting
from tests.kernels.kernel_testing import INTERPRETER_TESTS

# The child run takes ~20 s on two busy cores; a hung interpreter fails the test instead of the suite.
CHILD_TIMEOUT_S = 180


@pytest.mark.skipif(triton_interpreting(), reason="this process already collects the Triton tests itself")
def test_triton_kernels_match_references_under_the_interpreter() -> None:
    here = Path(__file__).parent
    files = sorted(str(p.relative_to(here.parent.parent)) for p in here.glob(INTERPRETER_TESTS))
    assert files, f"no {INTERPRETER_TESTS} next to {here}"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(BACKEND_ENV, None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=here.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
