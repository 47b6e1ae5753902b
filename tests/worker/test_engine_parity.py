"""The engine's greedy output equals transformers + peft token for token (each request alone there).

Batches mix several adapters and base requests with prompts of different lengths, and the same holds
with prefix-cache hits, with chunked prefill forced by a small token budget, and with preemption forced
by a tiny KV pool. Every family of `worker.models` (Llama, Qwen2, Mistral) serves such a batch, and the
sliding-window variants (Mistral's on every layer, Qwen2's on its upper layers) match past the window.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from loadtest.hf_reference import HFReference
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.adapters import ALL_LINEAR, MLP, AdapterSpec, build_adapter
from worker.modelzoo.make import ZooPaths

MAX_TOKENS = 12


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(length)]  # low ids hold the special tokens


def mixed_requests(
    zoo: ZooPaths,
    base: str,
    vocab: int,
    seed: int,
    n: int = 10,
    prefix: list[int] | None = None,
    *,
    adapter_names: list[str] | None = None,
    lengths: tuple[int, int] = (3, 90),
) -> list[Request]:
    """`n` requests cycling through no adapter and up to 5 of `adapter_names` (default: base's in the zoo)."""
    rng = random.Random(seed)
    names = zoo.adapter_names(base) if adapter_names is None else adapter_names
    adapters: list[str | None] = [None, *names[:5]]
    out = []
    for i in range(n):
        body = random_prompt(rng, rng.randrange(*lengths), vocab)
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
    # On a CPU every step of greedy requests picks its tokens inside the LM head (`kernels.lm_head`).
    assert engine.stats.fused_greedy_steps == engine.stats.steps


def test_steps_that_need_logits_compute_them_and_pick_the_same_tokens(zoo: ZooPaths) -> None:
    """The fused greedy pick and the argmax of the logits agree; a step needs logits when any row asks for
    logprobs or samples, and then none of its rows is fused."""
    fused = engine_for(zoo, "tiny")
    requests = mixed_requests(zoo, "tiny", fused.model_config.vocab_size, seed=1)
    picks = [r.token_ids for r in fused.generate(requests)]
    assert fused.stats.fused_greedy_steps == fused.stats.steps > 0
    with_logprobs = engine_for(zoo, "tiny")
    asking = [replace(r, params=replace(r.params, logprobs=0)) for r in requests]
    assert [r.token_ids for r in with_logprobs.generate(asking)] == picks
    assert with_logprobs.stats.fused_greedy_steps == 0
    mixed = engine_for(zoo, "tiny")
    short = replace(requests[0].params, temperature=1.0, max_tokens=3)  # the steps after it are greedy
    sampled = replace(requests[0], request_id="sampled", params=short)
    results = mixed.generate([*requests[1:], sampled])
    assert [r.token_ids for r in results[:-1]] == picks[1:]
    assert 0 < mixed.stats.fused_greedy_steps < mixed.stats.steps


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


@dataclass(frozen=True)
class Checkpoint:
    """A base model folder and the PEFT adapters served with it."""

    base: Path
    adapters: dict[str, Path]

    def engine(self, **overrides: Any) -> LLMEngine:
        return LLMEngine(self.base, EngineConfig(adapters=self.adapters, **overrides))


# The zoo builds no adapters for tiny-mistral; these are built for the tests, as the zoo builds its own.
MISTRAL_ADAPTERS = (
    AdapterSpec("qv-r8", 8, 16, ("q_proj", "v_proj"), seed=31, strength=0.15),
    AdapterSpec("all-r16", 16, 32, ALL_LINEAR, seed=32, strength=0.1),
    AdapterSpec("mlp-r32-rslora", 32, 32, MLP, seed=33, use_rslora=True, strength=0.1),
)
MISTRAL_WINDOW = 24  # not a multiple of the 16-token KV block
QWEN2_WINDOW = 16


def windowed_copy(src: Path, out: Path, **config: Any) -> Path:
    """A copy of checkpoint `src` whose config.json has `config`'s keys set (None: removed)."""
    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(config)
    raw = {k: v for k, v in raw.items() if v is not None or k == "sliding_window"}
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


@pytest.fixture(scope="session")
def checkpoints(zoo: ZooPaths, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    """Per family a checkpoint with ≥ 2 adapters, plus the windowed Mistral and Qwen2 variants."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("families")
    mistral = AutoModelForCausalLM.from_pretrained(str(zoo.base("tiny-mistral"))).eval()
    mistral_adapters = {
        spec.name: build_adapter(mistral, "tiny-mistral", spec, tmp / "adapters" / spec.name)
        for spec in MISTRAL_ADAPTERS
    }

    def zoo_adapters(base: str) -> dict[str, Path]:
        return {n: zoo.adapter(base, n) for n in zoo.adapter_names(base)}

    mistral_windowed = windowed_copy(
        zoo.base("tiny-mistral"), tmp / "mistral-window", sliding_window=MISTRAL_WINDOW
    )
    # Layer 0 full, layer 1 windowed, derived from max_window_layers as transformers does.
    qwen2_windowed = windowed_copy(
        zoo.base("tiny-qwen2"),
        tmp / "qwen2-window",
        use_sliding_window=True,
        sliding_window=QWEN2_WINDOW,
        max_window_layers=1,
        layer_types=None,
    )
    return {
        "llama": Checkpoint(zoo.base("tiny"), zoo_adapters("tiny")),
        "qwen2": Checkpoint(zoo.base("tiny-qwen2"), zoo_adapters("tiny-qwen2")),
        "mistral": Checkpoint(zoo.base("tiny-mistral"), mistral_adapters),
        "mistral-window": Checkpoint(mistral_windowed, mistral_adapters),
        "qwen2-window": Checkpoint(qwen2_windowed, zoo_adapters("tiny-qwen2")),
    }


class MemoReference:
    """An HF + peft reference that remembers its answers (the window tests ask twice per prompt)."""

    def __init__(self, ref: Any):
        self.ref, self.answers = ref, dict[tuple[tuple[int, ...], int, str | None], list[int]]()

    def greedy(self, prompt: list[int], max_tokens: int, adapter: str | None = None) -> list[int]:
        key = (tuple(prompt), max_tokens, adapter)
        if key not in self.answers:
            self.answers[key] = self.ref.greedy(prompt, max_tokens, adapter)
        return self.answers[key]


@pytest.fixture(scope="session")
def family_reference(
    checkpoints: dict[str, Checkpoint], hf_reference: Callable[[str], Any]
) -> Callable[[str], MemoReference]:
    """`family_reference(name)`: the HF + peft reference for `checkpoints[name]` (the zoo's shared one
    for the zoo's own checkpoints)."""
    shared = {"llama": "tiny", "qwen2": "tiny-qwen2"}
    cache: dict[str, MemoReference] = {}

    def get(name: str) -> MemoReference:
        if name not in cache:
            c = checkpoints[name]
            cache[name] = MemoReference(
                hf_reference(shared[name]) if name in shared else HFReference(c.base, c.adapters)
            )
        return cache[name]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_each_family_serves_a_mixed_adapter_batch_like_hf(
    zoo: ZooPaths,
    checkpoints: dict[str, Checkpoint],
    family_reference: Callable[[str], MemoReference],
    family: str,
) -> None:
    checkpoint = checkpoints[family]
    engine = checkpoint.engine()
    assert engine.model_config.model_type == family
    names = list(checkpoint.adapters)
    requests = mixed_requests(zoo, family, engine.model_config.vocab_size, 6, n=8, adapter_names=names)
    assert None in {r.adapter for r in requests} and len({r.adapter for r in requests} - {None}) >= 2
    assert_matches_reference(engine, requests, family_reference(family))
    assert engine.stats.steps < len(requests) * MAX_TOKENS  # requests really were batched together


@pytest.mark.parametrize(
    ("windowed", "full", "window"),
    [("mistral-window", "mistral", MISTRAL_WINDOW), ("qwen2-window", "qwen2", QWEN2_WINDOW)],
)
@pytest.mark.parametrize("chunk", [None, 16], ids=["whole-prefill", "chunked-prefill"])
def test_sliding_window_matches_hf_past_the_window(
    zoo: ZooPaths,
    checkpoints: dict[str, Checkpoint],
    family_reference: Callable[[str], MemoReference],
    windowed: str,
    full: str,
    window: int,
    chunk: int | None,
) -> None:
    checkpoint = checkpoints[windowed]
    engine = checkpoint.engine(**({"max_num_batched_tokens": chunk} if chunk else {}))
    cfg = engine.model_config
    assert window in cfg.layer_windows
    assert engine.max_model_len == cfg.max_position_embeddings == 2048  # not capped at the window
    names = list(checkpoint.adapters)
    requests = mixed_requests(zoo, windowed, cfg.vocab_size, 9, n=6, adapter_names=names, lengths=(30, 70))
    assert min(len(r.prompt_token_ids) for r in requests) > window
    assert_matches_reference(engine, requests, family_reference(windowed))
    # The window changes the answers: a forward that attended to the whole context would fail above.
    windowed_ref, full_ref = family_reference(windowed), family_reference(full)
    assert any(
        windowed_ref.greedy(list(r.prompt_token_ids), MAX_TOKENS, r.adapter)
        != full_ref.greedy(list(r.prompt_token_ids), MAX_TOKENS, r.adapter)
        for r in requests
    )


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
