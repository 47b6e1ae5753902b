"""Structured-output constraints as they cross from gateway to worker (`SamplingParams.guide`).

The gateway turns what a client asked for — `response_format` (`json_object`, `json_schema`), vLLM's
`guided_regex` / `guided_choice` / `guided_grammar` / `guided_json`, or a forced tool call — into one
`Guide`; the worker compiles it with its grammar engine and masks every step's logits with it, so the
output can only be a string of the guide's language. Torch-free and engine-free: just the description.

Kinds and their `value`:
- `json_schema`: a JSON Schema (a dict); `json_object` is the schema `{"type": "object"}`.
- `regex`: a regular expression the whole output must match.
- `choice`: a list of strings; the output is exactly one of them.
- `grammar`: an EBNF grammar text (xgrammar's GBNF dialect, root rule `root`), as vLLM's guided_grammar.
- `tool_calls`: `{"prefix": str, "begin": str, "end": str, "separator": str, "suffix": str, "args_key":
  str, "calls": [{"name": str, "parameters": schema}], "parallel": bool}`: the output is `prefix`, then
  `begin + {"name": <one of calls>, <args_key>: <its parameters>} + end` once, or (parallel) one or more
  times separated by `separator`, then `suffix` — a model family's call syntax (`gateway.tool_formats`).
  The arguments validate against that function's `parameters` schema. `prefix`, `suffix` default to "",
  `separator` to a newline, `args_key` to "arguments".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class GuideKind(StrEnum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class Guide:
    kind: GuideKind
    value: Any  # JSON-serializable, as the module docstring says per kind

    def to_json(self) -> str:
        return json.dumps({"type": self.kind.value, "value": self.value}, separators=(",", ":"))

    @staticmethod
    def from_json(raw: str) -> Guide:
        """Raises ValueError on anything that is not a guide."""
        try:
            d = json.loads(raw)
            return Guide(GuideKind(d["type"]), d["value"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a structured-output guide: {e}") from e


ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
