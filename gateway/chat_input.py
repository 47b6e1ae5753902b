"""Chat messages as the gateway passes them to the chat template (`gateway.tools.prompt_messages`).

Each message is normalized to `{"role", "content": str}`: `developer` is `system`, text content parts are
joined (other parts are refused), an assistant's `tool_calls` are kept (`{"id", "type": "function",
"function": {"name", "arguments": str}}`, its `content` then may be null), and a tool result keeps its
`tool_call_id`. The legacy `function` role is a tool result, an assistant's `function_call` one tool call.
Anything else is a 400 naming the message's field.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import bad_request


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation, normalized: `{"role", "content": str}`, with an assistant's `tool_calls`
    (`{"id", "type", "function": {"name", "arguments": str}}`) and a tool result's `tool_call_id`.
    `developer` is `system`; the legacy `function` role is a tool result and `function_call` a tool call."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise bad_request(f"{where} needs a role of system, user, assistant or tool.", param=f"{where}.role")
    role = {"developer": "system", "function": "tool"}.get(m["role"], m["role"])
    calls = _tool_calls(m, where) if role == "assistant" else []
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones
        content = "".join(_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content))
    if content is None and calls:  # an assistant turn that only calls tools
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string.", param=f"{where}.content")
    out: dict[str, Any] = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"{where}.{key} must be a string.", param=f"{where}.{key}")
                out[key] = m[key]
    return out


def _tool_calls(m: dict[str, Any], where: str) -> list[dict[str, Any]]:
    raw = m.get("tool_calls")
    if raw is None and m.get("function_call") is not None:  # legacy: one call
        raw = [{"id": "call_0", "type": "function", "function": m["function_call"]}]
        where = f"{where}.function_call"
    elif raw is None:
        return []
    else:
        where = f"{where}.tool_calls"
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list of tool calls.", param=where)
    calls = []
    for j, c in enumerate(raw):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or c.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
            or not isinstance(c.get("id", ""), str)
        ):
            raise bad_request(
                f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments': str}}}}.",
                param=at,
            )
        function = {"name": fn["name"], "arguments": fn["arguments"]}
        calls.append({"id": c.get("id") or f"call_{j}", "type": "function", "function": function})
    return calls


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise bad_request(f"{where}: only text content parts are supported.", param=where)
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string.", param=f"{where}.text")
    return text
