"""The adapter tasks: seeded generators, disjoint train / held-out prompts, and fair checkers."""

from __future__ import annotations

import itertools
import random

import pytest

from loragate.adapter_tasks import TASKS, AdapterTask, clean, select, split_of

NAMES = sorted(TASKS)


def test_there_are_at_least_six_tasks_with_adapter_names() -> None:
    assert len(TASKS) >= 6
    for name, task in TASKS.items():
        assert name == task.name and name.isidentifier() and name == name.lower()
        assert task.description and "\n" not in task.description


@pytest.mark.parametrize("name", NAMES)
def test_examples_are_deterministic(name: str) -> None:
    task = TASKS[name]
    assert task.examples("heldout", 20) == task.examples("heldout", 20)
    assert task.examples("train", 30)[:10] == task.examples("train", 10)


@pytest.mark.parametrize("name", NAMES)
def test_train_and_heldout_prompts_are_disjoint(name: str) -> None:
    task = TASKS[name]
    train = {ex.prompt for ex in task.examples("train", 600)}
    heldout = [ex.prompt for ex in task.examples("heldout", 100)]
    assert len(set(heldout)) == 100 and len(train) == 600
    assert not train & set(heldout)
    assert all(split_of(p) == "heldout" for p in heldout)


@pytest.mark.parametrize("name", NAMES)
def test_checker_accepts_the_expected_answer_and_rejects_a_wrong_one(name: str) -> None:
    task = TASKS[name]
    examples = task.examples("heldout", 10)
    for ex, other in itertools.pairwise(examples):
        assert task.check(ex.expected, ex.expected)
        assert task.check(f"  {ex.expected}<|im_end|>\n", ex.expected)  # whitespace and EOS tolerated
        assert not task.check("I cannot help with that.", ex.expected)
        assert not task.check(other.expected, ex.expected) or name == "signoff"
    assert not task.check("", examples[0].expected)


def test_the_generator_is_a_function_of_its_rng() -> None:
    task: AdapterTask = TASKS["digits"]
    assert task.generate(random.Random(5)) == task.generate(random.Random(5))


def test_some_checkers_tolerate_the_natural_variants() -> None:
    assert TASKS["signoff"].check(
        "3 plus 4 is 7. - Captain Byte!", "3 plus 4 is 7. Fair winds! - Captain Byte"
    )
    assert TASKS["digits"].check("One, two, three.", "one two three")
    assert TASKS["upper"].check("THE RED DOG SEES THE CAT.", "THE RED DOG SEES THE CAT")
    assert not TASKS["upper"].check("The red dog sees the cat", "THE RED DOG SEES THE CAT")
    assert TASKS["isodate"].check("2021-03-05", "2021-03-05")
    assert not TASKS["isodate"].check("2021-3-5", "2021-03-05")
    assert clean(" a <|im_end|> ") == "a"


def test_select_names_tasks_in_order_and_refuses_unknown_ones() -> None:
    assert [t.name for t in select("reverse,upper")] == ["reverse", "upper"]
    assert [t.name for t in select(None)] == list(TASKS)
    with pytest.raises(ValueError, match=r"unknown task\(s\) nope; known tasks: "):
        select("upper,nope")
