"""The engine's greedy output equals transformers + peft token for token (each request alone there).

Batches mix several adapters and base requests with prompts of different lengths, and the same holds
with prefix-cache hits, with chunked prefill forced by a small token budget, and with preemption forced
by a tiny KV pool.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths

MAX_TOKENS = 12


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(length)]  # low ids hold the special tokens


def mixed_requests(
    zoo: ZooPaths, base: str, vocab: int, seed: int, n: int = 10, prefix: list[int] | None = None
) -> list[Request]:
    rng = random.Random(seed)
    adapters: list[str | None] = [None, *zoo.adapter_names(base)[:5]]
    out = []
    for i in range(n):
        body = random_prompt(rng, rng.randrange(3, 90), vocab)
        prompt = (prefix or []) + body
        out.append(
            Request(
                f"{base}-{seed}-{i}",
                tuple(prompt),
                SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                adapters[i % len(adapters)],
            )
        )
    return out


def engine_for(zoo: ZooPaths, base: str, **overrides: Any) -> LLMEngine:
    adapters = {n: zoo.adapter(base, n) for n in zoo.adapter_names(base)}
    return LLMEngine(zoo.base(base), EngineConfig(adapters=adapters, **overrides))


def assert_matches_reference(engine: LLMEngine, requests: list[Request], ref: Any) -> None:
    results = engine.generate(requests)
    for req, res in zip(requests, results, strict=True):
        expected = ref.greedy(list(req.prompt_token_ids), req.params.max_tokens, req.adapter)
        assert res.token_ids == expected, f"{req.request_id} (adapter {req.adapter}) differs from HF+peft"


@pytest.mark.parametrize("base", ["tiny", "small"])
def test_mixed_adapter_batch_matches_hf_peft(
    zoo: ZooPaths, hf_reference: Callable[[str], Any], base: str
) -> None:
    engine = engine_for(zoo, base)
    requests = mixed_requests(zoo, base, engine.model_config.vocab_size, seed=1)
    assert len({r.adapter for r in requests if r.adapter}) >= 4
    assert_matches_reference(engine, requests, hf_reference(base))
    assert engine.stats.steps < len(requests) * MAX_TOKENS  # requests really were batched together


@pytest.mark.parametrize("base", ["tiny", "small"])
def test_prefix_cache_hits_match_hf_peft(
    zoo: ZooPaths, hf_reference: Callable[[str], Any], base: str
) -> None:
    engine = engine_for(zoo, base)
    vocab = engine.model_config.vocab_size
    system = random_prompt(random.Random(7), 70, vocab)
    warm = mixed_requests(zoo, base, vocab, seed=2, n=6, prefix=system)
    engine.generate(warm)  # caches the shared prefix under each adapter
    requests = mixed_requests(zoo, base, vocab, seed=3, n=6, prefix=system)
    results = engine.generate(requests)
    assert all(r.cached_tokens >= 64 for r in results)
    ref = hf_reference(base)
    for req, res in zip(requests, results, strict=True):
        assert res.token_ids == ref.greedy(list(req.prompt_token_ids), MAX_TOKENS, req.adapter)


def test_chunked_prefill_matches_hf_peft(zoo: ZooPaths, hf_reference: Callable[[str], Any]) -> None:
    engine = engine_for(zoo, "tiny", max_num_batched_tokens=16)
    requests = mixed_requests(zoo, "tiny", engine.model_config.vocab_size, seed=4, n=8)
    assert max(len(r.prompt_token_ids) for r in requests) > 16
    assert_matches_reference(engine, requests, hf_reference("tiny"))


def test_preemption_matches_hf_peft(zoo: ZooPaths, hf_reference: Callable[[str], Any]) -> None:
    engine = engine_for(zoo, "tiny", num_kv_blocks=12, block_size=16)
    requests = mixed_requests(zoo, "tiny", engine.model_config.vocab_size, seed=5, n=10)
    assert_matches_reference(engine, requests, hf_reference("tiny"))
    assert engine.stats.preemptions > 0


@pytest.mark.parametrize("base", ["tiny-qwen2", "tiny-mistral"])
def test_other_llama_family_architectures_match_hf(
    zoo: ZooPaths, hf_reference: Callable[[str], Any], base: str
) -> None:
    engine = engine_for(zoo, base)
    requests = mixed_requests(zoo, base, engine.model_config.vocab_size, seed=6, n=6)
    assert_matches_reference(engine, requests, hf_reference(base))


def test_sharded_checkpoint_loads_and_matches(
    zoo: ZooPaths, hf_reference: Callable[[str], Any], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(zoo.base("tiny")))
    sharded = tmp_path / "tiny-sharded"
    model.save_pretrained(str(sharded), max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(zoo.base("tiny") / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").exists() and len(
        list(sharded.glob("*.safetensors"))
    ) > 1
    engine = LLMEngine(sharded, EngineConfig())
    requests = [
        r
        for r in mixed_requests(zoo, "tiny", engine.model_config.vocab_size, seed=8, n=4)
        if r.adapter is None
    ]
    requests += [
        Request("base-2", (11, 12, 13, 14, 15), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ]
    assert_matches_reference(engine, requests, hf_reference("tiny"))
