"""Stage tokenize: the prompt's token ids (chat template with the request's tools, or the completion prompt
as text or ids), the completion budget within the model's context, and the sampling parameters (token ids
in them checked against the vocabulary); and `render_spec`, how the answer's choices show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway import protocol, tools
from gateway.choice_render import RenderSpec
from gateway.context import GatewayContext
from gateway.errors import bad_request
from gateway.pipeline.parse import Call
from gateway.pipeline.resolve import Resolved
from gateway.tokenize import ModelTokenizer
from loragate.tracing import span
from loragate.types import SamplingParams


@dataclass(frozen=True)
class Prompt:
    text: str | None  # the rendered prompt (None: a completion prompt given as token ids)
    token_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams


def tokenize(ctx: GatewayContext, call: Call, resolved: Resolved) -> Prompt:
    text: str | None
    with span(ctx.tracer, "tokenize") as tokenize_span:
        tok = ctx.tokenizers.get(resolved.model_dir)
        if call.chat:
            messages, shown = tools.prompt_messages(call.messages, call.parsed.tools, tok.tool_format)
            text = tok.render_chat(messages, tools=shown)
            ids = tok.encode(text)
        else:
            text, given = protocol.completion_prompt(call.body, tok.vocab_size)
            ids = given if given is not None else tok.encode(text or "")
        tokenize_span.set_attribute("gen_ai.usage.input_tokens", len(ids))
    if not ids:
        raise bad_request("The prompt is empty after tokenization.", param="prompt")
    max_tokens = completion_budget(len(ids), call.parsed.max_tokens, resolved.max_model_len, call.chat)
    check_sampling(call.parsed.params, max_tokens, tok.vocab_size)
    params = protocol.sampling_params(call.parsed, max_tokens)
    if call.chat:  # a forced call and the text in the template's own call syntax
        params = tools.tool_params(params, call.parsed.tools, tools.output_format(tok.tool_format))
    if call.server_span.is_recording():
        call.server_span.set_attributes(
            {
                "gen_ai.request.max_tokens": max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
            }
        )
    return Prompt(text, tuple(ids), max_tokens, params)


def completion_budget(prompt_tokens: int, asked: int | None, limit: int, chat: bool) -> int:
    """The completion's `max_tokens`: as asked, else the rest of the context (chat) or 16 (completion,
    as OpenAI's default); 400 when prompt and completion do not fit in `limit` tokens."""
    max_tokens = asked or (limit - prompt_tokens if chat else 16)
    if prompt_tokens + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or the completion length.",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    return max_tokens


def check_sampling(params: dict[str, Any], max_tokens: int, vocab_size: int) -> None:
    """What the parse stage could not check: token ids against the vocabulary, min_tokens against the
    completion budget."""
    for token_id, _ in params.get("logit_bias", ()):
        if token_id >= vocab_size:
            raise bad_request(f"'logit_bias' token ids must be below {vocab_size}.", param="logit_bias")
    if any(t >= vocab_size for t in params.get("stop_token_ids", ())):
        raise bad_request(f"'stop_token_ids' must be below {vocab_size}.", param="stop_token_ids")
    if params.get("min_tokens", 0) > max_tokens:
        raise bad_request(f"'min_tokens' must not exceed max_tokens ({max_tokens}).", param="min_tokens")


def render_spec(call: Call, tok: ModelTokenizer, prompt: Prompt) -> RenderSpec:
    """How the choices of `prompt` show (the endpoint's shape; logprobs, tool calls and echo as asked)."""
    params, parsed = prompt.params, call.parsed
    echo = None
    if parsed.echo:
        echo = prompt.text if prompt.text is not None else tok.decode(prompt.token_ids)
    return RenderSpec(
        call.chat,
        logprobs=tok.token_text if params.logprobs is not None else None,
        echo=echo,
        echo_first=prompt.token_ids[0] if echo is not None and params.prompt_logprobs is not None else None,
        tools=parsed.tools.names if parsed.tools is not None and parsed.tools.parsed else None,
        parallel_tools=parsed.tools.parallel if parsed.tools is not None else True,
        tool_format=tools.output_format(tok.tool_format),
    )
