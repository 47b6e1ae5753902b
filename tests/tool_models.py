"""Checkpoints whose chat templates speak a model family's own tool-call syntax, for tests.

No Llama 3 or Mistral checkpoint is reachable here, so each is the zoo's tiny model (its weights linked,
not copied) with a tokenizer and a chat template shaped like the family's: the family's marker token is a
special added token (it takes the place of `<|pad|>`, whose id the tiny model has an embedding for), and
the template renders tools, calls and results the way the family's does, including its refusals (Mistral's
9-character call ids, Llama 3's one call per turn). The templates are written here, in their families'
style, not copied from any model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MISTRAL_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
{%- if message.role == 'system' %}{{ message.content }}

{% elif message.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}
{%- if call.id is not string or call.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id is not string or message.tool_call_id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}[TOOL_RESULTS]
{{- {'content': message.content, 'call_id': message.tool_call_id} | tojson }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

LLAMA3_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}<|start_header_id|>
{{- 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>

{% if message.role == 'user' and tools and loop.first -%}
Given the following functions, please respond with a JSON for a function call with its proper arguments \
that best answers the given prompt. Respond in the format {"name": function name, "parameters": dictionary \
of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{% endif %}
{%- if message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set call = message.tool_calls[0].function -%}
{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}
{%- else %}{{ message.content }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

FAMILIES = {"mistral": ("[TOOL_CALLS]", MISTRAL_TEMPLATE), "llama3": ("<|python_tag|>", LLAMA3_TEMPLATE)}


def family_model(base: Path, dest: Path, family: str) -> Path:
    """`base` (a zoo checkpoint) as a `family` model in `dest`: its marker a special token, its template."""
    marker, template = FAMILIES[family]
    dest.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            continue
        target = dest / item.name
        if item.suffix == ".safetensors":
            target.symlink_to(item.resolve())
        elif item.is_dir():
            shutil.copytree(item, target)
        else:
            shutil.copy2(item, target)
    tok = json.loads((base / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["content"] == "<|pad|>":
            added["content"], added["special"] = marker, True
    vocab = tok["model"]["vocab"]
    if "<|pad|>" in vocab:
        vocab[marker] = vocab.pop("<|pad|>")
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    for added in (config.get("added_tokens_decoder") or {}).values():
        if added.get("content") == "<|pad|>":
            added["content"] = marker
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    (dest / "chat_template.jinja").write_text(template)
    return dest
