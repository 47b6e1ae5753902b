"""Gateway tokenization (no torch) equals the model's own: `transformers` chat template and the ids the
engine sees; its block hashes are the worker's prefix-cache hashes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer

from gateway.tokenize import load_tokenizer
from loragate.hashing import block_hashes
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief. ünïcödé 🙂"},
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "return x"},
        {"role": "user", "content": "and g?"},
    ],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(zoo: ZooPaths, messages: list[dict[str, str]]) -> None:
    ours = load_tokenizer(zoo.base("tiny"))
    hf = AutoTokenizer.from_pretrained(str(zoo.base("tiny")))
    text = ours.render_chat(messages)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]


def test_gateway_block_hashes_are_the_workers_prefix_cache_hashes(zoo: ZooPaths) -> None:
    ours = load_tokenizer(zoo.base("tiny"))
    prompt = ours.encode(ours.render_chat(CHATS[1]) * 3)
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(adapters={"tiny:qv-r8": zoo.adapter("tiny", "qv-r8")}))
    engine.generate([Request("h", tuple(prompt), SamplingParams(max_tokens=1), "tiny:qv-r8")])
    expected = block_hashes(prompt, engine.config.block_size, "tiny:qv-r8")
    # The finished sequence's prompt blocks are in the engine's prefix cache under exactly these hashes.
    assert len(expected) >= 2 and all(h in engine.blocks.cached for h in expected)
    assert not any(h in engine.blocks.cached for h in block_hashes(prompt, engine.config.block_size, None))


def test_the_gateway_imports_no_torch() -> None:
    code = "import sys, gateway.app, gateway.main, policies; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def sentencepiece_style(tmp_path: Path) -> Path:
    """A Llama-2-style tokenizer: BPE over `▁`-joined words with byte fallback (`<0xHH>` pieces for what
    the vocabulary lacks), decoded by Replace('▁', ' ') + ByteFallback + Fuse + Strip(one leading space)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", *letters, "▁h", "▁he", "▁hel", "▁hell", "▁hello", "▁w", "or", "ld"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"), ("▁", "w")]
    merges += [("o", "r"), ("l", "d")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


@pytest.mark.parametrize("text", ["hello world", "hello wörld ✓ again", "héllo\n  world 🙂"])
def test_sentencepiece_token_texts_keep_spaces_and_bytes(tmp_path: Path, text: str) -> None:
    """Each token's bytes, concatenated, are the text the model reads (SentencePiece prepends one `▁`):
    a word's leading space is kept and a byte-fallback piece is its byte, not U+FFFD."""
    tok = load_tokenizer(sentencepiece_style(tmp_path))
    ids = tok.encode(text)
    assert tok.metaspace and not tok.byte_level and tok.decode(ids) == text
    pieces = [tok.token_text(i) for i in ids]
    assert b"".join(bytes(raw) for _, raw in pieces) == b" " + text.encode()
    assert pieces[0][0].startswith(" ")  # the first word's `▁`: decoding it alone strips the space
    assert tok.token_text(tok.encode("é")[-1]) == ("\ufffd", [0xA9])  # a character's last byte
    assert tok.token_text(1) == ("<s>", list(b"<s>"))  # an added token is its content


def test_token_texts_are_remembered(tmp_path: Path) -> None:
    tok = load_tokenizer(sentencepiece_style(tmp_path))
    first = tok.token_text(5)
    first[1].append(0)  # a caller changing what it got changes nothing
    assert tok.token_text(5) == ("\x02", [2]) and 5 in tok._texts
