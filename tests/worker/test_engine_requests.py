"""`check_request`: what can never run is refused up front, one named reason per case; what fits exactly
is accepted (the bounds are inclusive)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loragate.types import Request, SamplingParams
from worker.engine_requests import check_request
from worker.engine_types import EngineInfo

INFO = EngineInfo(Path("/m"), max_model_len=64, vocab_size=100, block_size=16, max_loras=2, max_num_seqs=8,
                  device="cpu", dtype=torch.float32)  # fmt: skip


def req(prompt: tuple[int, ...], max_tokens: int = 8, resumed: tuple[int, ...] = ()) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=max_tokens), resume_token_ids=resumed)


@pytest.mark.parametrize(
    ("request_", "kv_blocks", "message"),
    [
        pytest.param(req(()), 8, "the prompt is empty", id="empty prompt"),
        pytest.param(req((1, 100)), 8, r"token ids must be in \[0, 100\)", id="id past the vocabulary"),
        pytest.param(req((-1, 2)), 8, r"token ids must be in \[0, 100\)", id="negative id"),
        pytest.param(req((1,), 2, resumed=(5, 6)), 8, "nothing left to generate", id="resumed reach max"),
        pytest.param(req((1,) * 60, 5), 8, "= 65 exceeds the model's context length of 64", id="too long"),
        pytest.param(
            req((1,) * 20, 20), 2, "needs 40 tokens of KV but the pool holds 32", id="pool too small"
        ),
    ],
)
def test_a_request_that_can_never_run_is_refused(request_: Request, kv_blocks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_request(request_, INFO, kv_blocks)


@pytest.mark.parametrize(
    ("request_", "kv_blocks"),
    [
        pytest.param(req((0, 99)), 1, id="ids at both ends of the vocabulary"),
        pytest.param(req((1,) * 56, 8), 4, id="exactly the context length and the pool"),
        pytest.param(req((1,), 3, resumed=(5, 6)), 1, id="one token left after resuming"),
    ],
)
def test_a_request_that_fits_exactly_is_accepted(request_: Request, kv_blocks: int) -> None:
    check_request(request_, INFO, kv_blocks)
