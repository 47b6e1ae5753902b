"""Tool-call formats: how a model family writes its calls, so that the gateway forces and reads them in
the syntax the model was trained on.

A chat template that renders `tools` itself shows its family's syntax in its own text; `detect` reads it:
- `hermes` (Qwen2/2.5, Hermes, and loragate's default format, `gateway.tools`): one block per call,
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, anywhere in the answer.
- `llama3_json` (Llama 3.1/3.2/3.3): the answer is the call, `{"name": "f", "parameters": {...}}`, maybe
  after `<|python_tag|>`; several calls are separated by `;`. The template shows one call per turn, so a
  forced call is one call.
- `mistral` (Mistral/Mixtral templates of the v3 tokenizer): `[TOOL_CALLS][{"name": "f", "arguments":
  {...}}, ...]` after any content. `[TOOL_CALLS]` is a control token, which the worker would drop from the
  text, so these requests keep special tokens (`SamplingParams.skip_special_tokens`). The template
  requires call ids of 9 letters and digits: calls get such ids, and ids a client sends back are mapped
  to 9 characters (the same id always to the same 9).
A template that mentions tools in any other syntax gets the default format (tools and the instruction in
the system turn, calls read as `hermes`): loragate reads back only what it knows how to read.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from dataclasses import dataclass
from typing import Any

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolFormat:
    """A family's call syntax. A forced answer is `prefix`, then calls separated by `separator`, each
    `begin + {"name": <name>, <args_key>: <arguments>} + end`, then `suffix`."""

    name: str
    prefix: str = ""
    begin: str = ""
    end: str = ""
    separator: str = "\n"
    suffix: str = ""
    args_key: str = "arguments"
    keep_special: bool = False  # a marker is a control token: the worker keeps special tokens in the text
    parallel: bool = True  # the template shows several calls in one assistant turn
    short_ids: bool = False  # call ids are 9 letters and digits

    def call_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def template_id(self, call_id: Any) -> Any:
        """A client's call id as the template accepts it (ids are mapped only where the format needs)."""
        if not self.short_ids or not isinstance(call_id, str):
            return call_id
        if len(call_id) == 9 and all(c in _ALNUM for c in call_id):
            return call_id
        n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        return "".join(_ALNUM[(n // len(_ALNUM) ** i) % len(_ALNUM)] for i in range(9))


HERMES = ToolFormat("hermes", begin="<tool_call>\n", end="\n</tool_call>", separator="\n")
LLAMA3_JSON = ToolFormat("llama3_json", separator="; ", args_key="parameters", parallel=False)
MISTRAL = ToolFormat(
    "mistral", prefix="[TOOL_CALLS][", separator=",", suffix="]", keep_special=True, short_ids=True
)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect(template: str | None) -> ToolFormat | None:
    """The call syntax of a chat template that renders tools itself; None when it does not, or in a
    syntax loragate cannot read back (those requests use the default format)."""
    if not template or "tools" not in template:
        return None
    if "[TOOL_CALLS]" in template:  # the list form; newer templates' `[TOOL_CALLS]name[ARGS]{...}` is not it
        return None if "[ARGS]" in template else MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return LLAMA3_JSON
    return None
