"""Request fields this server cannot honour: refused (400 naming the field) unless absent, null or one of
their neutral values — never accepted and ignored. Fields not listed here and not read elsewhere are
passed over, as clients send harmless extras (`store`, `metadata`, `service_tier`, `prompt_cache_key`,
`reasoning_effort`, ...) that change nothing about the tokens sampled.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import bad_request

# name -> its neutral values (what the server does anyway); () = any non-null value is refused.
REFUSED: dict[str, tuple[Any, ...]] = {
    # OpenAI's
    "suffix": ("",),  # insertion
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
    "best_of": (1,),
    "functions": ([],),  # the legacy form of tools: use `tools`
    "function_call": ("none",),
    # vLLM's sampling extras
    "allowed_token_ids": (),
    "bad_words": ([],),
    "include_stop_str_in_output": (False,),
    "prompt_logprobs": (),  # request-level; completions' `echo` with `logprobs` gives the prompt's
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "early_stopping": (False,),
    "truncate_prompt_tokens": (),
    "spaces_between_special_tokens": (True,),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "priority": (0,),
    "vllm_xargs": ({},),
    # vLLM's structured-output options (the engine is xgrammar, JSON whitespace its own)
    "guided_whitespace_pattern": (),
    "guided_decoding_backend": ("auto", "xgrammar"),
    # vLLM's prompt options: the template is the model's, rendered with the generation prompt, no
    # special tokens added beyond what it writes
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "add_special_tokens": (False,),
    "documents": ([],),
    "mm_processor_kwargs": ({},),
}

# Honoured on one endpoint only: on the other, refused the same way.
COMPLETIONS_REFUSED: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (),  # chat's; completions' `logprobs` is the count
}


def refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    tables = (REFUSED,) if chat else (REFUSED, COMPLETIONS_REFUSED)
    for table in tables:
        for name, neutral in table.items():
            value = body.get(name)
            if value is not None and not _is_neutral(value, neutral):
                shown = value.get("type", value) if isinstance(value, dict) else value
                shown = shown if isinstance(shown, str | int) else type(shown).__name__
                raise bad_request(f"'{name}' {shown!r} is not supported by this server.", param=name)


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """`value` is one of `neutral`, a boolean only where a boolean is (True == 1 in Python)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)
