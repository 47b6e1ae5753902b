"""Incremental detokenization: UTF-8 split across tokens, stop strings held back and cut."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from worker.detokenizer import DetokenizerState, IncrementalDetokenizer
from worker.modelzoo.make import ZooPaths


@pytest.fixture(scope="module")
def tokenizer(zoo: ZooPaths) -> Tokenizer:
    return Tokenizer.from_file(str(zoo.base("tiny") / "tokenizer.json"))


def stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(tok)
    state = DetokenizerState.start([], stop)
    deltas = []
    for i in range(1, len(ids) + 1):
        hit = detok.update(state, ids[:i])
        last = hit or i == len(ids)
        deltas.append(detok.delta(state, finished=last))
        if hit:
            return deltas, True
    return deltas, False


@pytest.mark.parametrize(
    "text", ["héllo wörld", "emoji 🙂🚀 and 漢字 mixed", "def f(x):\n    return x ** 2\n"]
)
def test_deltas_are_whole_characters_and_add_up(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    deltas, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_multibyte_character_split_over_tokens_is_released_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂").ids
    assert len(ids) > 1  # a rare emoji is several byte tokens in a small BPE vocabulary
    deltas, _ = stream(tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🙂"


def test_stop_string_is_cut_and_never_partially_streamed(tokenizer: Tokenizer) -> None:
    text = "import os\nimport sys\nprint(os.getcwd())\n"
    ids = tokenizer.encode(text).ids
    deltas, hit = stream(tokenizer, ids, stop=("sys\nprint",))
    assert hit
    # Deltas only append, so an exact total proves no piece of the stop string ("sys", "sys\n", …) leaked.
    assert "".join(deltas) == "import os\nimport "


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma delta").ids
    deltas, hit = stream(tokenizer, ids, stop=("delta", "beta"))
    assert hit and "".join(deltas) == "alpha "


@pytest.mark.parametrize("extra", [0, 40], ids=["few-stops-find", "many-stops-one-regex"])
def test_many_stop_strings_cut_at_the_earliest_like_a_few(tokenizer: Tokenizer, extra: int) -> None:
    # Duplicates, regex metacharacters and strings that never occur must not change where the text is cut.
    never = tuple(f"zz{i}(.*)" for i in range(extra))
    stop = ("gamma", "a+b", "beta", "beta", *never, "a b")
    ids = tokenizer.encode("alpha a+b beta gamma").ids
    deltas, hit = stream(tokenizer, ids, stop=stop)
    assert hit and "".join(deltas) == "alpha "
