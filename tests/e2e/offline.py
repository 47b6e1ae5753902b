"""The offline engine's greedy reference texts, generated in the test process on one CPU thread.

The stack's workers run beside the test process, one or two threads each on a two-core machine; an
offline engine on torch's default pool (every core) then spins its OpenMP threads against theirs and
against whatever else runs: 600 greedy tokens of `tiny` took 54 s on two threads and 8.6 s on one on a
loaded two-core host. The texts do not depend on the thread count (greedy, the same checkpoint).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op pool at one thread for the block, then as it was (other tests share the process)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
