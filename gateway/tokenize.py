"""Tokenization in the gateway, without torch: `tokenizers` for ids, a sandboxed Jinja chat template.

The tokenizer of a base model is read from the checkpoint directory its workers announce (a shared
filesystem or the same image), once per directory. The chat template is rendered the way
`transformers.apply_chat_template` does (sandboxed Jinja, trim/lstrip blocks, `raise_exception`, `tools=`
when it renders tools in a syntax `gateway.tool_formats` reads). A token's text for log-probabilities is its
own piece, as exact bytes read as UTF-8: for byte-level BPE through GPT-2's byte-to-character map; for
SentencePiece-style vocabularies (Metaspace: `▁` for a space, `<0xHH>` byte-fallback pieces) with `▁` as a
space and each byte piece as its byte — decoding the token alone would strip its leading space and turn a
byte piece into U+FFFD. Added tokens, and other vocabularies, are their decoded text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.errors import bad_request
from gateway.tool_formats import ToolFormat
from gateway.tool_formats import detect as detect_tool_format


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass(frozen=True)
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: Any  # a compiled jinja2 Template, or None
    special: dict[str, str]
    vocab_size: int  # including added tokens: token ids in a prompt must be below it
    tool_format: ToolFormat | None = None  # the call syntax of a template that renders `tools` itself
    byte_level: bool = False  # pieces are byte-level BPE (GPT-2's byte-to-character map)
    metaspace: bool = False  # pieces are SentencePiece's: `▁` a space, `<0xHH>` one byte (byte fallback)
    added: frozenset[int] = frozenset()  # added tokens' ids: their text is their content
    # token id -> (text, bytes), filled as tokens are shown (logprobs show the same few thousand again)
    _texts: dict[int, tuple[str, list[int]]] = field(default_factory=dict, compare=False, repr=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """One token's text and its UTF-8 bytes (a piece of a character: its exact bytes, text U+FFFD)."""
        known = self._texts.get(token_id)
        if known is None:
            raw = self._piece_bytes(token_id)
            known = self._texts[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return known[0], list(known[1])

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None or token_id in self.added:
            return self.decode([token_id]).encode()
        if self.byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if self.metaspace:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte[1], 16)]) if byte else piece.replace("▁", " ").encode()
        return self.decode([token_id]).encode()  # other tokenizers

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise bad_request(
                "This model has no chat template; use /v1/completions.", code="no_chat_template"
            )
        extra = {"tools": tools} if tools is not None else {}
        try:
            return str(
                self.chat_template.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **extra
                )
            )
        except (TemplateError, TypeError) as e:  # TypeError: the template's own operations on a value
            raise bad_request(f"The chat template rejected the messages: {e}", param="messages") from e


def _byte_map() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte back to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_map()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(tok: Tokenizer) -> tuple[bool, bool]:
    """(byte-level BPE, SentencePiece-style metaspace), read from the tokenizer's decoder."""
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    steps = [decoder, *decoder.get("decoders", [])]
    byte_level = any(d.get("type") == "ByteLevel" for d in steps)
    metaspace = any(
        d.get("type") == "Metaspace"
        or (d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "▁")
        for d in steps
    )
    return byte_level, metaspace


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: keys in their order, no HTML escaping (Jinja's own sorts and escapes)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def load_tokenizer(model_dir: Path) -> ModelTokenizer:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config: dict[str, Any] = {}
    cfg_path = model_dir / "tokenizer_config.json"
    if cfg_path.exists():
        config = json.loads(cfg_path.read_text())
    source = None
    if (model_dir / "chat_template.jinja").exists():
        source = (model_dir / "chat_template.jinja").read_text()
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    special = {
        name: value if isinstance(value, str) else value.get("content", "")
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if isinstance(value := config.get(name), str | dict)
    }
    template = env.from_string(source) if source else None
    byte_level, metaspace = _decoder_kinds(tok)
    return ModelTokenizer(
        tok,
        template,
        special,
        tok.get_vocab_size(with_added_tokens=True),
        tool_format=detect_tool_format(source),
        byte_level=byte_level,
        metaspace=metaspace,
        added=frozenset(tok.get_added_tokens_decoder()),
    )


class TokenizerStore:
    def __init__(self) -> None:
        self._by_dir: dict[str, ModelTokenizer] = {}

    def get(self, model_dir: str) -> ModelTokenizer:
        if model_dir not in self._by_dir:
            self._by_dir[model_dir] = load_tokenizer(Path(model_dir))
        return self._by_dir[model_dir]
