"""Stage tokenize: the completion budget within the model's context."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.pipeline.prompt import completion_budget


@pytest.mark.parametrize(
    ("prompt", "asked", "limit", "chat", "expected"),
    [
        (10, 5, 100, False, 5),
        (10, None, 100, False, 16),
        (10, None, 100, True, 90),
        (10, 90, 100, True, 90),
        (90, None, 100, False, None),
        (10, 91, 100, True, None),
    ],
    ids=[
        "asked",
        "completion default 16",
        "chat: the rest of the context",
        "exactly fits",
        "default does not fit",
        "one token over",
    ],
)
def test_completion_budget(
    prompt: int, asked: int | None, limit: int, chat: bool, expected: int | None
) -> None:
    if expected is not None:
        assert completion_budget(prompt, asked, limit, chat) == expected
        return
    with pytest.raises(APIError) as e:
        completion_budget(prompt, asked, limit, chat)
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
    assert e.value.param == ("messages" if chat else "prompt")
