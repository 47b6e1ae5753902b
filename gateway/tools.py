"""Tool calling, request side: the `tools` a chat request offers, its `tool_choice`, and how both reach
the prompt and the sampler.

A chat template whose tool syntax `gateway.tool_formats` knows (Hermes/Qwen, Llama 3 JSON, Mistral)
renders the tools itself (`tools=` as transformers passes them, and the conversation's tool calls and
results as the template expects); calls are forced and read back in that syntax. Other templates get the
default format, Hermes/Qwen style, which `gateway.tool_calls` reads back:
- the functions' JSON signatures in a system block inside `<tools></tools>`, with the instruction to
  answer a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- an assistant message's `tool_calls` rendered in that same form after its content;
- `tool` results as a user turn, each inside `<tool_response></tool_response>` (consecutive ones merged).

`tool_choice` `required` or a named function forces the call through the grammar (a `tool_calls` guide
in the model's syntax: the output is one call — `required` with `parallel_tool_calls`, where the syntax
has several calls per turn, one or more — whose arguments validate against the function's `parameters`);
`auto` leaves the model free and parses its output; `none` shows the tools but reads nothing back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from gateway.errors import bad_request
from gateway.tool_formats import HERMES, ToolFormat
from loragate.guides import Guide, GuideKind
from loragate.types import SamplingParams

CALL_BEGIN, CALL_END = HERMES.begin, HERMES.end
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON Schema

    def signature(self) -> dict[str, Any]:
        """The OpenAI tool object, as templates and the default format show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # none / auto / required / named
    named: str | None  # the function a named choice forces
    parallel: bool  # parallel_tool_calls

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def parsed(self) -> bool:
        """Whether the output is read back into tool calls."""
        return self.choice != "none"

    def guide(self, fmt: ToolFormat = HERMES) -> Guide | None:
        """The constraint that forces a call (`required`, named) in `fmt`'s syntax, else None."""
        if self.choice not in ("required", "named"):
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t.name == self.named]
        calls = [{"name": t.name, "parameters": t.parameters} for t in chosen]
        parallel = self.parallel and self.choice == "required" and fmt.parallel
        value = {
            "prefix": fmt.prefix,
            "begin": fmt.begin,
            "end": fmt.end,
            "separator": fmt.separator,
            "suffix": fmt.suffix,
            "args_key": fmt.args_key,
            "calls": calls,
            "parallel": parallel,
        }
        return Guide(GuideKind.TOOL_CALLS, value)


def output_format(template_format: ToolFormat | None) -> ToolFormat:
    """The syntax calls are forced and read in: the template's, else the default format's."""
    return template_format or HERMES


def tool_params(params: SamplingParams, request: ToolRequest | None, fmt: ToolFormat) -> SamplingParams:
    """`params` for a request whose calls are in `fmt`: a forced call in that syntax, and special tokens
    kept in the text where a marker is one."""
    if request is None:
        return params
    forced = request.guide(fmt)
    if forced is not None:
        params = replace(params, guide=forced.to_json())
    if fmt.keep_special and request.parsed:
        params = replace(params, skip_special_tokens=False)
    return params


def parse_tools(body: dict[str, Any], chat: bool) -> ToolRequest | None:
    """The request's tools and tool choice (None: no tools); 400 naming what is wrong."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    if not chat:
        raise bad_request("'tools' are for /v1/chat/completions.", param="tools")
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of function tools.", param="tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise bad_request("Tool names must be unique.", param="tools")
    kind, named = _choice(choice, set(names))
    return ToolRequest(tools, kind, named, True if parallel is None else parallel)


def _tool(raw: Any, where: str) -> Tool:
    if (
        not isinstance(raw, dict)
        or raw.get("type") != "function"
        or not isinstance(raw.get("function"), dict)
    ):
        raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}.", param=where)
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'.",
            param=f"{where}.function.name",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(
            f"'{where}.function.description' must be a string.", param=f"{where}.function.description"
        )
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad_request(
            f"'{where}.function.parameters' must be a JSON Schema (an object).",
            param=f"{where}.function.parameters",
        )
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad_request(f"'{where}.function.strict' must be a boolean.", param=f"{where}.function.strict")
    return Tool(name, description, parameters)


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_request(
                f"'tool_choice' names {name!r}, which is not one of the tools.", param="tool_choice"
            )
        return "named", name
    raise bad_request(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}.",
        param="tool_choice",
    )


# --- the prompt ----------------------------------------------------------------------------------------

_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{signatures}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def prompt_messages(
    messages: list[dict[str, Any]], request: ToolRequest | None, template_format: ToolFormat | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools=` argument to render with: the template's own format when it has one
    (`template_format`), else the default format folded into plain messages (and no `tools=`)."""
    signatures = [t.signature() for t in request.tools] if request else None
    if template_format is not None:
        return [_for_template(m, template_format) for m in messages], signatures
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            blocks = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join([m["content"], *blocks] if m["content"] else blocks)
            out.append({"role": "assistant", "content": content})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if signatures:
        system = _SYSTEM.format(signatures="\n".join(json.dumps(s, ensure_ascii=False) for s in signatures))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def call_text(name: str, arguments: str) -> str:
    """One call in the default format (`arguments` as the client gave it: JSON text)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments  # not JSON: shown as the string it is
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{CALL_BEGIN}{body}{CALL_END}"


def _for_template(m: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    """A message as tool-aware templates (transformers') expect it: call arguments as a mapping, call ids
    as the format requires them."""
    if "tool_call_id" in m:
        return {**m, "tool_call_id": fmt.template_id(m["tool_call_id"])}
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        try:
            args: Any = json.loads(c["function"]["arguments"])
        except ValueError:
            args = c["function"]["arguments"]
        function = {"name": c["function"]["name"], "arguments": args}
        calls.append({**c, "id": fmt.template_id(c.get("id")), "function": function})
    return {**m, "tool_calls": calls}
