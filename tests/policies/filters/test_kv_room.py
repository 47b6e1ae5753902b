"""`kv-room`: free KV tokens must hold the uncached prompt plus decode headroom; unknown KV is kept."""

from __future__ import annotations

from typing import Any

import pytest

from policies.filters.kv_room import KVRoom
from tests.policies.factories import candidate, request

# headroom: 16 + 0.25 * 64 = 32 tokens; block size 16.
PARAMS = {"headroom_tokens": 16, "max_tokens_fraction": 0.25}


@pytest.mark.parametrize(
    ("prompt_tokens", "cand", "kept"),
    [
        pytest.param(100, {"kv_blocks_free": 0, "kv_blocks_total": 0}, True, id="unknown KV size: keep"),
        pytest.param(96, {"kv_blocks_free": 8}, True, id="prompt and headroom fit exactly"),
        pytest.param(97, {"kv_blocks_free": 8}, False, id="one token too many"),
        pytest.param(160, {"kv_blocks_free": 8, "cached_blocks": 4}, True, id="cached blocks need no room"),
    ],
)
def test_kv_room(prompt_tokens: int, cand: dict[str, Any], kept: bool) -> None:
    f = KVRoom("kv-room", PARAMS)
    assert f.keep(request(prompt_tokens=prompt_tokens, max_tokens=64), candidate(**cand)) is kept
