"""The tasks the shipped SmolLM2 adapters are trained for, each with a program that checks an answer.

A task is a named transformation whose result a program can check: capital letters, reversed word order,
digits spelled as words, ISO dates, square brackets around words, a persona's sign-off. Each one has a
seeded prompt generator `(rng) -> (user_message, expected)` and a checker `(response, expected) -> bool`
that strips whitespace and a trailing end-of-turn token. The user message states the instruction in plain
words, so the base model gets a fair chance; `loragate eval` sends the same held-out prompts to the base
model and to its adapter. Train and held-out prompts are disjoint by construction: a prompt is held out
exactly when a hash of its text falls in one bucket of five, so no held-out prompt is ever trained on,
however many training examples are drawn. Pure Python (no torch): the gateway-side eval imports it.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "heldout"]


def _wordlist(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _wordlist(
    "apple river house garden window teacher doctor bird cat dog horse table chair book letter market "
    "forest mountain ocean city village train road bridge flower tree cloud star moon sun rain snow "
    "friend mother father sister brother child farmer king queen bread milk water coffee music song "
    "paper pencil door wall lamp boat ship car bus school church castle island lake field"
)
_ADJECTIVES = _wordlist(
    "big small old young happy sad red blue green yellow quiet loud cold warm fast slow bright dark "
    "tall short kind brave calm clever gentle lazy busy rich poor"
)
_VERBS = _wordlist(
    "sees likes finds paints visits watches helps carries builds cleans follows loves opens reads "
    "moves pulls pushes draws"
)
_FIRST_NAMES = _wordlist(
    "Alice Bob Carla David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia Peter "
    "Quinn Rosa Sam Tina Victor Wendy Yusuf Zoe Hannah Omar Lucy Marco Nina Oscar"
)
_CITIES = _wordlist(
    "Paris London Berlin Madrid Rome Vienna Prague Lisbon Dublin Oslo Tokyo Cairo Lima Denver Boston "
    "Seattle Toronto Sydney Nairobi Mumbai"
)
_MONTHS = _wordlist("January February March April May June July August September October November December")
_DIGIT_WORDS = _wordlist("zero one two three four five six seven eight nine")


@dataclass(frozen=True)
class Example:
    prompt: str  # the user message
    expected: str


@dataclass(frozen=True)
class AdapterTask:
    """One adapter's task: its name (also the adapter's name), what it does, a generator and a checker."""

    name: str
    description: str
    generate: Callable[[random.Random], tuple[str, str]]
    check: Callable[[str, str], bool]

    def examples(self, split: Split, n: int) -> list[Example]:
        """`n` distinct examples of `split`, the same ones on every call (train ones are a prefix-stable
        sequence: asking for more extends the list)."""
        seed = int.from_bytes(hashlib.sha256(f"{self.name}:{split}".encode()).digest()[:8], "big")
        rng = random.Random(seed)
        seen: set[str] = set()
        out: list[Example] = []
        for _ in range(max(1000, 200 * n)):
            if len(out) == n:
                return out
            prompt, expected = self.generate(rng)
            if prompt in seen or (split_of(prompt) != split):
                continue
            seen.add(prompt)
            out.append(Example(prompt, expected))
        raise ValueError(f"task {self.name!r}: could not draw {n} distinct {split} examples")


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to: held out when its hash falls in bucket 0 of 5."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % 5
    return "heldout" if bucket == 0 else "train"


def clean(response: str) -> str:
    """The response without surrounding whitespace or a trailing end-of-turn token."""
    text = response.strip()
    for eos in ("<|im_end|>", "<|endoftext|>"):
        text = text.removesuffix(eos).strip()
    return text


def _words(text: str) -> list[str]:
    return text.split()


def _same_words(response: str, expected: str) -> bool:
    """Equal up to whitespace and one trailing full stop."""
    return _words(clean(response).removesuffix(".")) == _words(expected.removesuffix("."))


def _sentence(rng: random.Random) -> str:
    return (
        f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
        f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    )


def _upper(rng: random.Random) -> tuple[str, str]:
    sentence = _sentence(rng)
    return f"Rewrite this sentence in capital letters: {sentence}", sentence.upper()


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(_NOUNS, rng.randint(3, 5))
    return (
        f"Reverse the order of these words: {' '.join(words)}",
        " ".join(reversed(words)),
    )


def _digits(rng: random.Random) -> tuple[str, str]:
    number = str(rng.randint(100, 999_999))
    return (
        f"Spell out each digit of {number} as a word.",
        " ".join(_DIGIT_WORDS[int(d)] for d in number),
    )


def _check_digits(response: str, expected: str) -> bool:
    words = re.sub(r"[,.\-]", " ", clean(response).lower()).split()
    return words == expected.split()


def _iso_date(rng: random.Random) -> tuple[str, str]:
    year, month, day = rng.randint(1950, 2049), rng.randint(1, 12), rng.randint(1, 28)
    return (
        f"Write this date in the format YYYY-MM-DD: {_MONTHS[month - 1]} {day}, {year}",
        f"{year:04d}-{month:02d}-{day:02d}",
    )


def _check_exact(response: str, expected: str) -> bool:
    return clean(response).removesuffix(".") == expected


SIGNOFF = "Captain Byte"


def _signoff(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    return (
        f"What is {a} plus {b}? Answer in one sentence, then sign off as {SIGNOFF}.",
        f"{a} plus {b} is {a + b}. Fair winds! - {SIGNOFF}",
    )


def _check_signoff(response: str, expected: str) -> bool:
    return clean(response).rstrip(".!").endswith(SIGNOFF)


def _brackets(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(_NOUNS + _ADJECTIVES, rng.randint(3, 5))
    return (
        f"Put each word in square brackets: {' '.join(words)}",
        " ".join(f"[{w}]" for w in words),
    )


TASKS: dict[str, AdapterTask] = {
    t.name: t
    for t in (
        AdapterTask("upper", "rewrite a sentence in capital letters", _upper, _same_words),
        AdapterTask("reverse", "reverse the order of a few words", _reverse, _same_words),
        AdapterTask("digits", "spell each digit of a number as a word", _digits, _check_digits),
        AdapterTask("signoff", "answer a sum and sign off as Captain Byte", _signoff, _check_signoff),
        AdapterTask("isodate", "write a spelled-out date as YYYY-MM-DD", _iso_date, _check_exact),
        AdapterTask("brackets", "put each word in square brackets", _brackets, _same_words),
    )
}


def select(names: str | None) -> list[AdapterTask]:
    """The tasks named in a comma-separated list (all when None or empty), in the order given."""
    if not names:
        return list(TASKS.values())
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; known tasks: {', '.join(TASKS)}")
    return [TASKS[n] for n in chosen]
