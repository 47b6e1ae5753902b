"""The shipped SmolLM2 adapters: one per task, small PEFT fp16 checkpoints, packaged; and our engine
serving them gives transformers + peft's greedy tokens on held-out prompts."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from loragate.adapter_tasks import TASKS
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.train_adapters import SHIPPED_DIR, SPECS

REPO = Path(__file__).resolve().parents[2]
# Every task's adapter changes its answer within the first three tokens (most at the first), so 12
# greedy tokens compare both the adapters' and the base model's decoding well past where they part.
MAX_TOKENS = 12


def test_every_task_has_a_shipped_adapter_in_peft_fp16_format() -> None:
    assert set(SPECS) == set(TASKS)
    assert sorted(p.name for p in SHIPPED_DIR.iterdir() if p.is_dir()) == sorted(TASKS)
    for name, spec in SPECS.items():
        folder = SHIPPED_DIR / name
        assert sorted(p.name for p in folder.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", spec.rank, spec.alpha)
        assert cfg["base_model_name_or_path"] == "smollm2"
        assert cfg["target_modules"] == sorted(spec.targets)
        assert bool(cfg["use_rslora"]) == spec.use_rslora
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
            assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}  # noqa: SIM118
    assert sum(p.stat().st_size for p in SHIPPED_DIR.rglob("*") if p.is_file()) < 24 * 1024**2
    assert any(s.use_rslora for s in SPECS.values()) and len({s.targets for s in SPECS.values()}) >= 3


def test_the_adapters_are_package_data() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["worker"]
    shipped = {p.relative_to(REPO / "worker") for p in SHIPPED_DIR.rglob("*") if p.is_file()}
    assert shipped and all(any(p.match(pattern) for pattern in patterns) for p in shipped)


@pytest.mark.slow
def test_engine_serves_the_adapters_like_transformers_and_peft(smollm2: Path) -> None:
    from loadtest.hf_reference import HFReference

    adapters = {name: SHIPPED_DIR / name for name in TASKS}
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    requests = []
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, task in TASKS.items():  # a held-out prompt of each task, with its adapter and without
        (ex,) = task.examples("heldout", 1)
        ids = tok.apply_chat_template(
            [{"role": "user", "content": ex.prompt}], add_generation_prompt=True, tokenize=True
        )
        prompt = tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)
        requests.append(Request(f"{name}-lora", prompt, params, name))
        requests.append(Request(f"{name}-base", prompt, params, None))
    engine = LLMEngine(smollm2, EngineConfig(adapters=adapters))
    results = engine.generate(requests)
    ref = HFReference(smollm2, adapters)
    for req, res in zip(requests, results, strict=True):
        expected = ref.greedy(list(req.prompt_token_ids), MAX_TOKENS, req.adapter)
        assert res.token_ids == expected, f"{req.request_id} (adapter {req.adapter}) differs from HF+peft"
    # The adapters really act: each changes the greedy answer to its held-out prompt.
    by_id = {req.request_id: res.token_ids for req, res in zip(requests, results, strict=True)}
    assert all(by_id[f"{name}-lora"] != by_id[f"{name}-base"] for name in TASKS)
