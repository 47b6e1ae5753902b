"""OpenAI request parsing and response shapes for `/v1/completions` and `/v1/chat/completions`.

Validation errors name the offending parameter (`param`) and say what is allowed. Unsupported features
that would change results (n > 1, logprobs, penalties, structured output, tools, insertion, audio) are
refused rather than silently ignored. An explicit `null` means "not given", as OpenAI's clients send it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from loragate.types import SamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_N = 128  # choices per prompt
MAX_PROMPTS = 256  # prompts in one completions request


@dataclass(frozen=True)
class ParsedRequest:
    model: Any
    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: dict[str, Any]  # SamplingParams fields except max_tokens
    user: str | None


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be a number between {lo} and {hi}.", param=name)
    return float(value)


def _int(body: dict[str, Any], name: str, lo: int, default: int | None, hi: int = 2**31 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be an integer between {lo} and {hi}.", param=name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", param=name)
    return bool(value)


# Fields that would change the result, refused unless absent, null or one of their neutral values.
_REFUSED: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),  # json_object / json_schema: structured output
    "tool_choice": ("none",),
    "suffix": ("",),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in _REFUSED.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            shown = value.get("type", value) if isinstance(value, dict) else value
            raise bad_request(f"'{name}' {shown!r} is not supported by this server.", param=name)


def parse_common(body: dict[str, Any], chat: bool) -> ParsedRequest:
    _int(body, "n", 1, 1, MAX_N)  # choices per prompt (`gateway.pipeline.choices`)
    _refuse_unsupported(body)
    for name in ("logprobs", "top_logprobs", "echo", "best_of", "logit_bias", "tools", "functions"):
        if body.get(name) not in (None, False, 0, 1 if name == "best_of" else None):
            raise bad_request(f"'{name}' is not supported by this server.", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise bad_request(f"'{name}' is not supported by this server (use 0).", param=name)
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)  # any number: the body size limit bounds them
    else:
        raise bad_request("'stop' must be a string or a list of non-empty strings.", param="stop")
    if stop == "":
        raise bad_request("'stop' must not be empty.", param="stop")
    max_tokens = _int(body, "max_completion_tokens", 1, None) if chat else None
    max_tokens = _int(body, "max_tokens", 1, max_tokens)
    # Signed or unsigned 64-bit, as clients send either; the worker hashes it into its generator's seed.
    seed = _int(body, "seed", SEED_MIN, None, SEED_MAX)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string.", param="user")
    params = {
        "temperature": _number(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _number(body, "top_p", 1e-9, 1.0, 1.0),
        "top_k": max(0, _int(body, "top_k", -1, 0) or 0),  # -1 (vLLM's "off") = 0
        "seed": seed,
        "stop": stops,
        "ignore_eos": _bool(body, "ignore_eos"),
    }
    return ParsedRequest(
        body.get("model"), stream, bool(options.get("include_usage")), max_tokens, params, user
    )


def sampling_params(parsed: ParsedRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, **parsed.params)
    except ValueError as e:
        raise bad_request(str(e)) from e


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise bad_request(
                f"messages[{i}] needs a role of system, user, assistant or tool.", param=f"messages[{i}].role"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            content = "".join(_text_part(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content))
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string.", param=f"messages[{i}].content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise bad_request(f"{where}: only text content parts are supported.", param=where)
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string.", param=f"{where}.text")
    return text


def completion_prompts(body: dict[str, Any]) -> list[Any]:
    """The prompts of a completions request, each as `completion_prompt` reads one: a list of two or more
    strings or token-id lists is a batch (one prompt per item); anything else is one prompt."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and len(prompt) > 1 and all(_one_prompt(p) for p in prompt)):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' may hold at most {MAX_PROMPTS} prompts.", param="prompt")
    return prompt


def _one_prompt(item: object) -> bool:
    """A batch item: a string, or a list of token ids (checked by `completion_prompt`)."""
    return isinstance(item, str) or (
        isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
    )


def completion_prompt(body: dict[str, Any], vocab_size: int) -> tuple[str | None, list[int] | None]:
    """One prompt as text, or as token ids (a list of ints, or a list holding one such list); a batch is
    split first (`completion_prompts`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", param="prompt")
        return prompt, None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise bad_request(f"Token ids in 'prompt' must be in [0, {vocab_size}).", param="prompt")
        return None, list(prompt)
    raise bad_request(
        "'prompt' must be a string or a list of token ids (or a list of such prompts).", param="prompt"
    )


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def body(
    rid: str, model: str, chat: bool, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    """A whole (non-streamed) answer; `choices` from `gateway.choice_render.ChoiceRenderer.final`."""
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chunk(rid: str, model: str, created: int, chat: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One SSE chunk; `choices` from `gateway.choice_render.ChoiceRenderer.feed`."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def usage_chunk(rid: str, model: str, created: int, chat: bool, use: dict[str, Any]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": use}
