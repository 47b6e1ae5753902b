"""OpenAI request parsing and response shapes for `/v1/completions` and `/v1/chat/completions`.

Validation errors name the offending parameter (`param`) and say what is allowed. Unsupported features
that would change results (insertion, predicted outputs, audio, best_of, legacy `functions`, vLLM's
extras this server lacks: `gateway.refused`) are refused rather than silently ignored. An explicit `null`
means "not given", as OpenAI's clients send it.
Structured outputs are read by `gateway.structured`, tools by `gateway.tools`; the parameters and their
ranges are listed in docs/API.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway.chat_input import chat_messages as chat_messages  # re-exported: callers read it here
from gateway.errors import bad_request
from gateway.refused import refuse_unsupported
from gateway.structured import request_guide
from gateway.tools import ToolRequest, parse_tools
from loragate.guides import Guide
from loragate.types import MAX_LOGPROBS, SamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_N = 128  # choices per prompt
MAX_PROMPTS = 256  # prompts in one completions request
# Lists the worker checks at every step of every sequence, bounded so that no request makes it pay for
# an unbounded list per token (OpenAI allows 4 stops and 300 biases; vLLM bounds none).
MAX_STOPS, MAX_STOP_CHARS = 256, 256  # `stop` strings, and characters in each
MAX_STOP_TOKEN_IDS = 256  # distinct `stop_token_ids`
MAX_LOGIT_BIAS = 300  # `logit_bias` entries (OpenAI's limit)


@dataclass(frozen=True)
class ParsedRequest:
    model: Any
    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: dict[str, Any]  # SamplingParams fields except max_tokens
    user: str | None
    tools: ToolRequest | None = None  # chat: the tools offered and the tool choice
    echo: bool = False  # completions: the prompt shown before the completion


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


def parse_common(body: dict[str, Any], chat: bool) -> ParsedRequest:
    _int(body, "n", 1, 1, MAX_N)  # choices per prompt (`gateway.pipeline.choices`)
    refuse_unsupported(body, chat)
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
        stops = tuple(dict.fromkeys(stop))  # duplicates dropped: the same stop checked once
    else:
        raise bad_request("'stop' must be a string or a list of non-empty strings.", param="stop")
    if stop == "":
        raise bad_request("'stop' must not be empty.", param="stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(
            f"'stop' may hold at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each.",
            param="stop",
        )
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
        **sampling_extras(body),
        **logprob_params(body, chat),
    }
    tools = parse_tools(body, chat)
    guide = structured_guide(body, tools)
    if guide is not None:
        params["guide"] = guide.to_json()
    echo = _bool(body, "echo")
    if echo and chat:
        raise bad_request("'echo' is for /v1/completions.", param="echo")
    return ParsedRequest(
        body.get("model"), stream, bool(options.get("include_usage")), max_tokens, params, user, tools, echo
    )


def sampling_extras(body: dict[str, Any]) -> dict[str, Any]:
    """Penalties, bias, min_tokens, min_p, stop token ids and vLLM's `skip_special_tokens`: only those
    given (a default is not sent). Token ids are checked against the vocabulary later, where the tokenizer
    is known."""
    out: dict[str, Any] = {}
    if body.get("skip_special_tokens") is False:
        out["skip_special_tokens"] = False
    elif body.get("skip_special_tokens") is not None:
        _bool(body, "skip_special_tokens")  # True is the default; anything else is a 400
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            out[name] = _number(body, name, -2.0, 2.0, 0.0)
    rep = body.get("repetition_penalty")
    if rep is not None:
        if isinstance(rep, bool) or not isinstance(rep, int | float) or not 0 < rep <= 1e9:
            raise bad_request("'repetition_penalty' must be a number above 0.", param="repetition_penalty")
        out["repetition_penalty"] = float(rep)
    if body.get("min_p") is not None:
        out["min_p"] = _number(body, "min_p", 0.0, 1.0, 0.0)
    if body.get("min_tokens") is not None:
        out["min_tokens"] = _int(body, "min_tokens", 0, 0)
    bias = body.get("logit_bias")
    if bias is not None:
        out["logit_bias"] = _logit_bias(bias)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < 2**31 for t in ids):
            raise bad_request("'stop_token_ids' must be a list of token ids.", param="stop_token_ids")
        distinct = tuple(dict.fromkeys(ids))
        if len(distinct) > MAX_STOP_TOKEN_IDS:
            raise bad_request(
                f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} distinct ids.",
                param="stop_token_ids",
            )
        out["stop_token_ids"] = distinct
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must be an object of token ids to numbers.", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries.", param="logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10):
            raise bad_request(f"'logit_bias' key {key[:20]!r} is not a token id.", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise bad_request("'logit_bias' values must be numbers between -100 and 100.", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def logprob_params(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """`logprobs` / `prompt_logprobs` of SamplingParams. Chat: `logprobs` (bool) and `top_logprobs`
    (0..20, only with logprobs, as OpenAI); completions: `logprobs` (0..5), with `echo` also the prompt's."""
    if chat:
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, None, MAX_LOGPROBS)
        if top is not None and not on:
            raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
        return {"logprobs": top or 0} if on else {}
    count = _int(body, "logprobs", 0, None, 5)
    if count is None:
        return {}
    echo = _bool(body, "echo")
    return {"logprobs": count, "prompt_logprobs": count} if echo else {"logprobs": count}


def structured_guide(body: dict[str, Any], tools: ToolRequest | None) -> Guide | None:
    """The one constraint on the output: a structured-output request or a forced tool call."""
    asked = request_guide(body)
    forced = tools.guide() if tools is not None else None
    if asked is not None and forced is not None:
        raise bad_request(
            f"A forced tool call ('tool_choice') cannot be combined with '{asked[0]}'.", param="tool_choice"
        )
    return forced or (asked[1] if asked else None)


def sampling_params(parsed: ParsedRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, **parsed.params)
    except ValueError as e:
        raise bad_request(str(e)) from e


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
