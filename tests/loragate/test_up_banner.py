"""The banner `up` prints once healthy: the keys, what is served, what `auto` picks, and requests to paste
(a chat question to the first model, and through its example adapter when it serves one)."""

from __future__ import annotations

from pathlib import Path

from loragate.adapter_tasks import TASKS
from loragate.stack_config import ModelSpec, StackConfig
from loragate.up_banner import EXAMPLE_ADAPTER, EXAMPLE_PROMPT, QUESTION, banner, describe_auto


def _adapters(root: Path, names: list[str]) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text("{}")
    (root / "notes").mkdir()  # no adapter_config.json: not served
    return root


def test_banner_shows_keys_models_auto_and_the_example_adapter(tmp_path: Path) -> None:
    adapters = _adapters(tmp_path / "a", ["alpha", EXAMPLE_ADAPTER])
    tiers = ({"max_score": 0.4, "model": "tiny"}, {"model": "smollm2"})
    stack = StackConfig(
        (ModelSpec("smollm2", "smollm2", adapters, 2), ModelSpec("tiny", "tiny", None)), tiers
    )
    text = banner("http://127.0.0.1:9", stack, "sk-1", "team", "adm", tmp_path)
    assert 'API key (tenant "team"): sk-1' in text and "admin token:           adm" in text
    assert (
        f"models: smollm2 (2 workers, 2 adapters: smollm2:alpha, smollm2:{EXAMPLE_ADAPTER}); tiny (1 worker)"
        in text
    )
    assert "routes by difficulty (0-1): ≤ 0.4 → tiny, higher → smollm2" in text
    assert f'"model": "smollm2", "messages": [{{"role": "user", "content": "{QUESTION}"}}]' in text
    example = f'"role": "user", "content": "{EXAMPLE_PROMPT}"'
    assert f'"model": "smollm2:{EXAMPLE_ADAPTER}", "messages": [{{{example}}}]' in text
    assert 'smollm2:alpha"' not in text
    assert f"state:  {tmp_path}  (removed on exit)" in text


def test_the_example_adapter_is_a_shipped_task_and_its_prompt_is_of_that_task() -> None:
    assert EXAMPLE_ADAPTER in TASKS
    assert EXAMPLE_PROMPT.startswith("Reverse the order of these words: ")


def test_without_the_example_task_the_first_adapter_is_shown_and_without_adapters_none(
    tmp_path: Path,
) -> None:
    adapters = _adapters(tmp_path / "a", ["zeta", "beta"])
    stack = StackConfig((ModelSpec("mine", "/m", adapters),), ({"model": "mine"},))
    assert '"model": "mine:beta"' in banner("http://h:1", stack, "k", "dev", "a", tmp_path)
    bare = StackConfig((ModelSpec("mine", "/m", None),), ({"model": "mine"},))
    assert '"model": "mine:' not in banner("http://h:1", bare, "k", "dev", "a", tmp_path)
    assert describe_auto(({"model": "mine"},)) == "every request → mine"
