"""Rebuild a GGUF file's byte-level BPE tokenizer as `tokenizer.json` and `tokenizer_config.json`.

A GGUF stores its vocabulary, merges, token types and a pre-tokenizer name (`tokenizer.ggml.pre`) as
metadata. The pre-tokenizer name selects how text is split before BPE, as llama.cpp does for the names
listed in `PRE_TOKENIZERS`: `gpt-2` splits GPT-2 style; `smollm` (and the StarCoder family it shares its
vocabulary style with) isolates every digit and then splits GPT-2 style, the way SmolLM2's own tokenizer
does. (transformers' GGUF loader does not know `smollm` and splits GPT-2 style only; the two differ only
on a run of whitespace right before a digit.) Any other name, and a file without one (llama.cpp's
`default`, whose rules differ from GPT-2's), is refused rather than tokenized differently. Control tokens
(`<|im_start|>`, …) are added as special tokens and user-defined tokens as plain added tokens, so neither
is ever cut into pieces (llama.cpp matches both whole before BPE; Hugging Face's non-special added tokens
are what llama.cpp's converter stores as user-defined); no BOS is inserted unless the file asks for one.
The end-of-generation ids are the file's EOS plus the control tokens llama.cpp itself treats as ending a
generation (`<|endoftext|>`, `<|im_end|>`, …).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from worker.hub.gguf_meta import GGUFConvertError, GGUFMetadata

_CONTROL = 3  # llama.cpp's token types: control and user-defined
_USER_DEFINED = 4
# Control-token texts llama.cpp treats as end of generation whatever the file's EOS id says.
_END_OF_GENERATION = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


# tokenizer.ggml.pre → the pre-tokenizer llama.cpp applies for it (its `default` is not GPT-2's split).
PRE_TOKENIZERS = {
    "gpt-2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "starcoder": _digits_then_gpt2_split,
    "refact": _digits_then_gpt2_split,
}


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """The `tokenizers.Tokenizer` the file's `tokenizer.ggml.*` metadata describes."""
    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConvertError(
            f"{meta.path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        found = "is missing (llama.cpp then splits its 'default' way)" if pre is None else f"is {pre!r}"
        raise GGUFConvertError(
            f"{meta.path}: tokenizer.ggml.pre {found}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConvertError(f"{meta.path}: tokenizer.ggml.tokens holds duplicate tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta, tokens)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in control_tokens(meta)]
    )
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in _tokens_of_type(meta, _USER_DEFINED)]
    )
    return tokenizer


def _post_processor(meta: GGUFMetadata, tokens: list[str]) -> processors.PostProcessor:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[bos_id]
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
    )


def _tokens_of_type(meta: GGUFMetadata, token_type: int) -> list[str]:
    tokens, types = meta.require("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type") or []
    return [token for token, kind in zip(tokens, types, strict=False) if kind == token_type]


def control_tokens(meta: GGUFMetadata) -> list[str]:
    return _tokens_of_type(meta, _CONTROL)


def end_of_generation_ids(meta: GGUFMetadata) -> list[int]:
    """The file's EOS id first, then every other control token that ends a generation in llama.cpp."""
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    ids = [int(eos)] if eos is not None else []
    control = set(control_tokens(meta))
    ids += [tokens.index(t) for t in _END_OF_GENERATION if t in control and tokens.index(t) not in ids]
    return ids


def _token(meta: GGUFMetadata, key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else str(meta.require("tokenizer.ggml.tokens")[token_id])


def tokenizer_config(meta: GGUFMetadata) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, BOS/EOS flags and the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, "bos_token_id"),
        "eos_token": _token(meta, "eos_token_id"),
        "pad_token": _token(meta, "padding_token_id"),
        "unk_token": _token(meta, "unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "additional_special_tokens": control_tokens(meta),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return config


def write_tokenizer(meta: GGUFMetadata, out_dir: Path) -> list[int]:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`; return the end-of-generation ids."""
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2) + "\n")
    return end_of_generation_ids(meta)
