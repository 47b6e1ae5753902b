"""Aliases: difficulty bands → model, shifted one rung down when the chosen pool is saturated."""

from __future__ import annotations

import pytest

from policies.alias_ladder import Alias, Rung, choose_rung, pool_saturation
from tests.policies.factories import candidate

AUTO = Alias("auto", (Rung("tiny", 0.4), Rung("small", 0.8), Rung("large")), 0.85, 0.15)


@pytest.mark.parametrize(
    ("score", "saturation", "model", "reason"),
    [
        pytest.param(0.2, {}, "tiny", "→ tiny", id="lowest band"),
        pytest.param(0.4, {}, "tiny", "→ tiny", id="band upper bound is inclusive"),
        pytest.param(0.9, {"large": 0.5}, "large", "→ large", id="under the threshold: no shift"),
        pytest.param(
            0.9, {"large": 0.9, "small": 0.1}, "small", "shifted to small", id="saturated: shift down"
        ),
        pytest.param(0.2, {"tiny": 0.99}, "tiny", "no smaller rung", id="saturated lowest rung stays"),
        pytest.param(0.9, {"large": 0.9, "small": 0.95}, "large", "as busy", id="lower rung as busy: stay"),
        pytest.param(0.99, {"large": 0.9}, "large", "too hard to shift", id="beyond the shift margin: stay"),
    ],
)
def test_choose_rung(score: float, saturation: dict[str, float], model: str, reason: str) -> None:
    chosen, why = choose_rung(AUTO, score, saturation)
    assert chosen == model and reason in why


def test_a_closed_last_band_still_takes_higher_scores() -> None:
    alias = Alias("a", (Rung("tiny", 0.4), Rung("small", 0.8)))
    assert alias.band(0.95) == 1 and alias.models == ("tiny", "small")


def test_pool_saturation_per_model() -> None:
    cands = [
        candidate("w1", outstanding=8),
        candidate("w2", outstanding=0),
        candidate("w3", outstanding=10, model="small"),
    ]
    assert pool_saturation(cands, capacity=10) == {"tiny": 0.4, "small": 1.0}
