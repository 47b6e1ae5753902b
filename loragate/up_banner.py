"""What `loragate up` prints once its stack is healthy: where it answers, the keys, what it serves (models,
adapters, what `auto` picks) and requests to paste: a chat question to the first model, the same through
one of its adapters, and the `openai` client."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loragate.stack_config import StackConfig
from loragate.stack_sources import adapter_names

# The shipped adapter the banner shows, with a prompt of its task (loragate/adapter_tasks.py): narrow task
# adapters answer their own kind of prompt; the base model gets this one wrong ("river, music, bread").
EXAMPLE_ADAPTER = "reverse"
EXAMPLE_PROMPT = "Reverse the order of these words: river bread music"
QUESTION = "What is the capital of France?"


def describe_auto(rungs: Sequence[Mapping[str, Any]]) -> str:
    if len(rungs) == 1:
        return f"every request → {rungs[0]['model']}"
    bands = [f"≤ {r['max_score']:g} → {r['model']}" for r in rungs[:-1]]
    return f"by difficulty (0-1): {', '.join(bands)}, higher → {rungs[-1]['model']}"


def example_adapter(names: list[str]) -> str | None:
    if EXAMPLE_ADAPTER in names:
        return EXAMPLE_ADAPTER
    return names[0] if names else None


def _chat(url: str, key: str, model: str, prompt: str = QUESTION) -> str:
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "{prompt}"}}], "max_tokens": 32}}'
    )
    return (
        f'  curl {url}/v1/chat/completions -H "Authorization: Bearer {key}" '
        f"-H \"Content-Type: application/json\" \\\n    -d '{body}'\n"
    )


def banner(url: str, stack: StackConfig, key: str, tenant: str, admin: str, state: Path) -> str:
    served = []
    for m in stack.models:
        names = adapter_names(m.adapters)
        shown = ", ".join(f"{m.name}:{n}" for n in names[:4]) + (", …" if len(names) > 4 else "")
        adapters = f", {len(names)} adapters: {shown}" if names else ""
        served.append(f"{m.name} ({m.workers} worker{'s' if m.workers > 1 else ''}{adapters})")
    first = stack.models[0]
    adapter = example_adapter(adapter_names(first.adapters))
    examples = _chat(url, key, first.name)
    if adapter == EXAMPLE_ADAPTER:
        examples += (
            f"  # its adapter {adapter!r} at its task (send the same to model {first.name!r} to compare):\n"
            + _chat(url, key, f"{first.name}:{adapter}", EXAMPLE_PROMPT)
        )
    elif adapter is not None:
        examples += f"  # through its adapter {adapter!r}:\n" + _chat(url, key, f"{first.name}:{adapter}")
    return f"""
loragate is up at {url}  (OpenAI-compatible)
  API key (tenant "{tenant}"): {key}
  admin token:           {admin}
  models: {"; ".join(served)}
  auto:   model "auto" routes {describe_auto(stack.auto)}

{examples}
  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key}'); \\
print(c.chat.completions.create(model='{first.name}', max_tokens=32, \\
messages=[{{'role': 'user', 'content': '{QUESTION}'}}]).choices[0].message.content)"

  models: curl {url}/v1/models -H "Authorization: Bearer {key}"
  fleet:  curl {url}/admin/workers -H "Authorization: Bearer {admin}"
  state:  {state}  (removed on exit)
Ctrl-C stops everything.
"""
