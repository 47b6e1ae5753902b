"""`seed` takes the whole signed and unsigned 64-bit range, refuses beyond it with 400 naming `seed`, and
distinct seeds give distinct samples at temperature 1 while equal seeds give equal ones (a real gateway
and a real `tiny` worker). Seeds that a 64-bit or 32-bit fold would merge are among those compared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import Stack, running_stack
from worker.modelzoo.make import ZooPaths

AUTH = {"Authorization": "Bearer sk-test-alice"}
# -1 and 2**64-1 are one seed to torch; 2**63-1, 2**64-1, 2**32-1 and -1 share their low 32 bits, which is
# all the CPU generator keeps; 0 and 2**32 likewise.
SEEDS = [-1, 2**64 - 1, 2**63 - 1, 2**32 - 1, 0, 2**32, -(2**63), 7]


@pytest.fixture(scope="module")
def stack(zoo: ZooPaths, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("seed-stack"))
    with running_stack(zoo, redis_server, workdir, workers=("seed-w1",)) as s:
        yield s


def sample(stack: Stack, seed: int) -> str:
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
    }
    r = httpx.post(f"{stack.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_distinct_seeds_give_distinct_samples_and_equal_seeds_equal_ones(stack: Stack) -> None:
    texts = {seed: sample(stack, seed) for seed in SEEDS}
    assert len(set(texts.values())) == len(SEEDS), texts
    for seed in (-1, 2**64 - 1, 0):
        assert sample(stack, seed) == texts[seed]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_outside_64_bits_is_400_naming_seed(stack: Stack, seed: int) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "seed": seed}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "seed"
