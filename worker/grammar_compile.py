"""Compiling a structured-output guide (`loragate.guides.Guide`) into an xgrammar grammar.

What each kind compiles to:
- `json_schema`: xgrammar's JSON Schema grammar, compact — no whitespace between tokens (separators ","
  and ":") so a weak model cannot loop forever on whitespace, and strict: properties and items the
  schema does not name are not generated (the output still validates against the schema as given).
  Keywords xgrammar 0.2.8 would silently not enforce (`UNENFORCED`) are refused rather than ignored.
- `regex`: the whole output matches it. `grammar`: xgrammar's EBNF, root rule `root`.
- `choice`: an alternation of the exact strings (EBNF literals, escaped).
- `tool_calls`: an xgrammar structural tag: `prefix`, then per function a tag `begin + {"name":<name>,
  "<args_key>":` + its compact parameters grammar + `}` + end`, so the name is a constant of its
  alternative, once or (parallel) one or more separated by `separator`, then `suffix`.
Anything malformed or that xgrammar cannot compile raises ValueError with a message for the client.
"""

from __future__ import annotations

import json
import re
from typing import Any

from loragate.guides import Guide, GuideKind

COMPACT = (",", ":")  # JSON separators: no whitespace anywhere
# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: "; the rest is for the client.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"  # as xgrammar prints it (see json_ebnf)
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
# JSON Schema keywords xgrammar 0.2.8 accepts but does not enforce (checked by tests/worker/test_grammar.py):
# an output could then break them, so a schema using them is refused. (`oneOf` is enforced as `anyOf`: a
# value matching two branches gets through; discriminated unions, the usual oneOf, never do.)
UNENFORCED = ("not", "uniqueItems", "dependentRequired", "dependentSchemas")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = (
    "items", "additionalProperties", "contains", "propertyNames", "not", "if", "then", "else",
    "unevaluatedProperties", "unevaluatedItems", "additionalItems",
)  # fmt: skip


def compile_guide(compiler: Any, guide: Guide) -> Any:
    """`guide` compiled by `compiler` (an `xgrammar.GrammarCompiler`); ValueError if it cannot be."""
    import xgrammar as xgr

    try:
        match guide.kind:
            case GuideKind.JSON_SCHEMA:
                return compiler.compile_grammar(
                    json_ebnf(_expect_schema(guide.value, "json_schema guide"), xgr)
                )
            case GuideKind.REGEX:
                return compiler.compile_regex(_expect_str(guide.value, "regex guide"))
            case GuideKind.GRAMMAR:
                return compiler.compile_grammar(_expect_str(guide.value, "grammar guide"))
            case GuideKind.CHOICE:
                return compiler.compile_grammar(choice_ebnf(guide.value))
            case GuideKind.TOOL_CALLS:
                return compiler.compile_structural_tag(tool_calls_tag(guide.value, xgr))
    except RuntimeError as e:  # xgrammar's errors (its own exception types are RuntimeErrors)
        raise ValueError(f"invalid {guide.kind.value} guide: {_CPP_PREFIX.sub('', str(e)).strip()}") from e
    raise ValueError(f"unknown guide kind {guide.kind!r}")


def choice_ebnf(value: Any) -> str:
    """The EBNF of "exactly one of these strings"."""
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        raise ValueError("a choice guide's value must be a non-empty list of strings")
    return "root ::= " + " | ".join(ebnf_literal(s) for s in value)


def ebnf_literal(s: str) -> str:
    """`s` as an xgrammar EBNF string literal (quotes, backslashes and control characters escaped)."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")  # exactly 4 digits: \x would read on into following hex digits
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def json_ebnf(schema: str, xgr: Any) -> str:
    r"""The EBNF of compact JSON valid for `schema` (JSON text).

    xgrammar 0.2.8 lets a length-bounded string (`minLength` / `maxLength`) hold raw control characters,
    which JSON forbids (json.loads refuses them): its characters rule is `[^\"\\\r\n]` where its free
    strings use `[^\0-\x1f\"\\\r\n]`. The grammar's text is patched to the latter.
    """
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=COMPACT)
    return str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def tool_calls_tag(value: Any, xgr: Any) -> str:
    """The structural tag (JSON text) of a `tool_calls` guide: see the module docstring."""
    if not isinstance(value, dict):
        raise ValueError("a tool_calls guide's value must be an object")
    begin, end = (
        _expect_str(value.get("begin"), "tool_calls begin"),
        _expect_str(value.get("end"), "tool_calls end"),
    )
    prefix, suffix = (
        _expect_str(value.get("prefix", ""), "tool_calls prefix"),
        _expect_str(value.get("suffix", ""), "tool_calls suffix"),
    )
    separator = _expect_str(value.get("separator", "\n"), "tool_calls separator")
    args_key = _expect_str(value.get("args_key", "arguments"), "tool_calls args_key")
    calls = value.get("calls")
    if not isinstance(calls, list) or not calls:
        raise ValueError("a tool_calls guide needs a non-empty list of calls")
    tags = []
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("each tool call must be an object with a name and parameters")
        name = _expect_str(call.get("name"), "tool call name")
        schema = _expect_schema(call.get("parameters", {"type": "object"}), f"parameters of {name!r}")
        tags.append(
            {
                "type": "tag",
                "begin": begin + '{"name":' + json.dumps(name) + "," + json.dumps(args_key) + ":",
                "content": {"type": "grammar", "grammar": json_ebnf(schema, xgr)},
                "end": "}" + end,
            }
        )
    fmt: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not value.get("parallel", False),
    }
    if prefix or suffix:
        ends = [{"type": "const_string", "value": prefix}] if prefix else []
        tail = [{"type": "const_string", "value": suffix}] if suffix else []
        fmt = {"type": "sequence", "elements": [*ends, fmt, *tail]}
    return json.dumps({"type": "structural_tag", "format": fmt})


def _expect_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string")
    return value


def _expect_schema(value: Any, what: str) -> str:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON Schema object")
    found = sorted(unenforced_keywords(value))
    if found:
        raise ValueError(f"{what} uses {', '.join(found)}, which the grammar engine cannot enforce")
    return json.dumps(value)


def unenforced_keywords(schema: Any) -> set[str]:
    """The `UNENFORCED` keywords used anywhere in `schema`, and `allOf` with more than one member (xgrammar
    0.2.8 keeps only one); property names and literal values (`enum`, `const`) are not keywords."""
    if not isinstance(schema, dict):
        return set()
    found = {k for k in UNENFORCED if k in schema and not (k == "uniqueItems" and schema[k] is False)}
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.add("allOf")
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            subs = list(value.values())
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            subs = value
        elif key in _SCHEMA_VALUES:
            subs = [value]
        else:
            continue
        for sub in subs:
            found |= unenforced_keywords(sub)
    return found
