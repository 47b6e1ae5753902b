"""Gateway tokenization (no torch) equals the model's own: `transformers` chat template and the ids the
engine sees; its block hashes are the worker's prefix-cache hashes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from gateway.tokenize import load_tokenizer
from loragate.hashing import block_hashes
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief. ünïcödé 🙂"},
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "return x"},
        {"role": "user", "content": "and g?"},
    ],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(zoo: ZooPaths, messages: list[dict[str, str]]) -> None:
    ours = load_tokenizer(zoo.base("tiny"))
    hf = AutoTokenizer.from_pretrained(str(zoo.base("tiny")))
    text = ours.render_chat(messages)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]


def test_gateway_block_hashes_are_the_workers_prefix_cache_hashes(zoo: ZooPaths) -> None:
    ours = load_tokenizer(zoo.base("tiny"))
    prompt = ours.encode(ours.render_chat(CHATS[1]) * 3)
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(adapters={"tiny:qv-r8": zoo.adapter("tiny", "qv-r8")}))
    engine.generate([Request("h", tuple(prompt), SamplingParams(max_tokens=1), "tiny:qv-r8")])
    expected = block_hashes(prompt, engine.config.block_size, "tiny:qv-r8")
    # The finished sequence's prompt blocks are in the engine's prefix cache under exactly these hashes.
    assert len(expected) >= 2 and all(h in engine.blocks.cached for h in expected)
    assert not any(h in engine.blocks.cached for h in block_hashes(prompt, engine.config.block_size, None))


def test_the_gateway_imports_no_torch() -> None:
    code = "import sys, gateway.app, gateway.main, policies; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
