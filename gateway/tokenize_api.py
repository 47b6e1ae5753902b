"""vLLM's `POST /tokenize` and `POST /detokenize` for the served models.

`/tokenize` takes `{"model", "prompt"}` or `{"model", "messages", "tools"?, "add_generation_prompt"?}` (the
chat template rendered as `/v1/chat/completions` renders it: tools, tool calls and tool results folded
the same way, so `count` is the `prompt_tokens` of a chat request of the same messages and tools) and
answers `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes `{"model", "tokens"}`
and answers `{"prompt"}`. The model is named as for generation — a base model, `base:adapter`, or an
adapter the key's tenant may use (adapters share their base's tokenizer) — and an adapter the tenant may
not use is 404 `model_not_found`, as in the model list; an alias (`auto`) names no tokenizer: 400.
`add_special_tokens` defaults to what generation does (none added), so `count` is the `prompt_tokens` a
completion of that prompt reports; vLLM's defaults differ (true for a prompt) and a client may ask for
them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.chat_input import chat_messages
from gateway.context import GatewayContext, read_json
from gateway.errors import APIError, bad_request, queue_unavailable
from gateway.model_catalog import AUTO
from gateway.pipeline.resolve import no_worker
from gateway.tokenize import ModelTokenizer
from gateway.tools import parse_tools, prompt_messages

# Chat-template options of vLLM's tokenize request this gateway cannot honour: refused, not ignored.
_REFUSED = ("chat_template", "chat_template_kwargs", "mm_processor_kwargs", "continue_final_message")


class TokenizeRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx  # one instance per request

    async def tokenize(self, request: Request) -> Response:
        body, tok, max_model_len = await self._model(request)
        special = _flag(body, "add_special_tokens")
        if body.get("messages") is not None:
            if body.get("prompt") is not None:
                raise bad_request("Send either 'prompt' or 'messages', not both.", param="prompt")
            for name in _REFUSED:
                if body.get(name) not in (None, False):
                    raise bad_request(f"'{name}' is not supported by this server.", param=name)
            generation = body.get("add_generation_prompt") is None or _flag(body, "add_generation_prompt")
            offered = parse_tools(body, chat=True)
            messages, shown = prompt_messages(chat_messages(body), offered, tok.tool_format)
            text = tok.render_chat(messages, generation, tools=shown)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("'prompt' must be a string (or send 'messages').", param="prompt")
            text = prompt
        ids = list(tok.tokenizer.encode(text, add_special_tokens=special).ids)
        strs = [tok.tokenizer.id_to_token(i) for i in ids] if _flag(body, "return_token_strs") else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> Response:
        body, tok, _ = await self._model(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("'tokens' must be a list of token ids.", param="tokens")
        if tokens and (min(tokens) < 0 or max(tokens) >= tok.vocab_size):
            raise bad_request(f"Token ids in 'tokens' must be in [0, {tok.vocab_size}).", param="tokens")
        return JSONResponse({"prompt": tok.decode(tokens)})

    async def _model(self, request: Request) -> tuple[dict[str, Any], ModelTokenizer, int]:
        """The body, and the tokenizer and context length of the model it names, as the key may use it."""
        ctx = self.ctx
        try:
            async with asyncio.timeout(ctx.settings.redis_timeout_s):
                tenant = await ctx.auth.tenant(request)
            body = await read_json(request, ctx.settings.max_body_bytes)
            model = body.get("model")
            if model == AUTO or (isinstance(model, str) and ctx.router.is_alias(model)):
                raise bad_request(f"'{model}' is an alias, not a model: name a model.", param="model")
            async with asyncio.timeout(ctx.settings.redis_timeout_s):
                target = await ctx.catalog.resolve(model, tenant)
        except APIError as e:
            if e.code != "adapter_not_allowed":
                raise
            raise APIError(  # as in the model list: another tenant's adapter does not exist for this key
                404, f"The model '{model}' does not exist.", param="model", code="model_not_found"
            ) from None
        except (RedisError, TimeoutError) as e:
            raise queue_unavailable() from e
        serving = ctx.fleet.serving(target.base)
        if not serving:
            raise no_worker(target.base, "right now")
        tok = ctx.tokenizers.get(serving[0].state.model_dir)
        return body, tok, min(w.state.max_model_len for w in serving)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", param=name)
    return bool(value)
