"""Tokenization in the gateway, without torch: `tokenizers` for ids, a sandboxed Jinja chat template.

The tokenizer of a base model is read from the checkpoint directory its workers announce (a shared
filesystem or the same image), once per directory. The chat template is rendered the way
`transformers.apply_chat_template` does (sandboxed Jinja, trim/lstrip blocks, `raise_exception`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.errors import bad_request


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass(frozen=True)
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: Any  # a compiled jinja2 Template, or None
    special: dict[str, str]
    vocab_size: int  # including added tokens: token ids in a prompt must be below it

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise bad_request(
                "This model has no chat template; use /v1/completions.", code="no_chat_template"
            )
        try:
            return str(
                self.chat_template.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self.special
                )
            )
        except TemplateError as e:
            raise bad_request(f"The chat template rejected the messages: {e}", param="messages") from e


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
    special = {
        name: value if isinstance(value, str) else value.get("content", "")
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if isinstance(value := config.get(name), str | dict)
    }
    template = env.from_string(source) if source else None
    return ModelTokenizer(tok, template, special, tok.get_vocab_size(with_added_tokens=True))


class TokenizerStore:
    def __init__(self) -> None:
        self._by_dir: dict[str, ModelTokenizer] = {}

    def get(self, model_dir: str) -> ModelTokenizer:
        if model_dir not in self._by_dir:
            self._by_dir[model_dir] = load_tokenizer(Path(model_dir))
        return self._by_dir[model_dir]
