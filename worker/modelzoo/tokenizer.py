"""The zoo's tokenizer: a byte-level BPE trained offline on Python's own standard library.

Every base model in the zoo shares this one tokenizer. It is trained from local files only, so the
zoo builds without network access, and from a fixed, sorted file list with a size cap, so training
takes a few seconds and gives the same `tokenizer.json` bytes on every rebuild on the same Python.
Like Qwen2 it never inserts a BOS token by itself, and it ships a ChatML chat template.

Qwen2 checkpoints get the same vocabulary, merges and special tokens behind Qwen2's own normaliser
and pre-tokenizer (`qwen2_pipeline`): transformers' `AutoTokenizer` always rebuilds a qwen2
checkpoint's tokenizer that way, whatever `tokenizer.json` says, and shipping that very pipeline
keeps `AutoTokenizer`, `PreTrainedTokenizerFast` and `tokenizers.Tokenizer.from_file` in agreement.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT_REGEX

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Their order fixes their ids (0..4); tests and the engine may rely on it.
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)

VOCAB_SIZE = 8192
# Enough text for sensible merges, little enough that training takes seconds, not minutes.
CORPUS_CAP_BYTES = 4_000_000
# Test suites hold odd encodings and generated data; they add noise, not useful merges.
_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus_files(cap_bytes: int = CORPUS_CAP_BYTES) -> list[Path]:
    """The standard-library `.py` files to train on, in a fixed order, up to `cap_bytes` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(
        (p for p in root.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    chosen: list[Path] = []
    total = 0
    for path in candidates:
        size = path.stat().st_size
        if total + size > cap_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def _read_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        # "replace" keeps the corpus (and so the merges) identical even for a stray non-UTF-8 file.
        yield path.read_bytes().decode("utf-8", errors="replace")


def train_bpe(files: list[Path] | None = None, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE `tokenizers.Tokenizer` (special tokens get ids 0..4)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(_read_texts(corpus_files() if files is None else files))
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def wrap_for_transformers(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` around `tokenizer` with its special tokens and chat template set."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # Saved as an explicit null: transformers' Qwen2Tokenizer would otherwise add an
        # "<|endoftext|>" unk token beyond the model's embedding table.
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        # Byte-exact round trips: no space clean-up on decode.
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the zoo tokenizer and wrap it for transformers; save it with `save_pretrained(dir)`."""
    return wrap_for_transformers(train_bpe())


def qwen2_pipeline(fast: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """`fast` with Qwen2's NFC normaliser and split regex in front of the byte-level BPE.

    Decoding then gives back the NFC form of the input, not always its exact bytes, as with Qwen2.
    """
    backend = Tokenizer.from_str(fast.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return wrap_for_transformers(backend)
