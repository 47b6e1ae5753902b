"""The structured-vs-free benchmark runs end to end on the tiny zoo model: both runs decode the same
number of tokens, the grammar's cost is measured, and the CLI's last line is the JSON summary."""

from __future__ import annotations

import json

import pytest

from loadtest.bench_structured import main


def test_bench_structured_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--model", "tiny", "--requests", "3", "--max-tokens", "12", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["model"] == "tiny" and result["requests"] == 3
    assert result["output_tokens"] == result["free_output_tokens"] > 0
    assert result["structured_tok_s"] > 0 and result["free_tok_s"] > 0
    assert result["structured_vs_free"] == pytest.approx(
        result["structured_tok_s"] / result["free_tok_s"], rel=0.01
    )
    assert result["mask_us_per_step"] > 0 and result["accept_us_per_token"] > 0
    assert 0 <= result["finished"] <= 1 and 0 <= result["valid_of_finished"] <= 1
