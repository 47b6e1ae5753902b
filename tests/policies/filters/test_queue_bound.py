"""`queue-bound`: outstanding requests strictly under `max_outstanding`."""

from __future__ import annotations

import pytest

from policies.filters.queue_bound import QueueBound
from tests.policies.factories import candidate, request


@pytest.mark.parametrize(
    ("outstanding", "kept"),
    [
        pytest.param(0, True, id="empty queue"),
        pytest.param(9, True, id="one under the bound"),
        pytest.param(10, False, id="at the bound"),
    ],
)
def test_queue_bound(outstanding: int, kept: bool) -> None:
    f = QueueBound("queue-bound", {"max_outstanding": 10})
    assert f.keep(request(), candidate(outstanding=outstanding)) is kept
