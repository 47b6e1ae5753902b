"""The model zoo: tokenizer, base checkpoints and LoRA adapters load, behave and rebuild identically."""

from __future__ import annotations

import copy
import json
import os
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from worker.modelzoo.adapters import ADAPTER_SPECS
from worker.modelzoo.bases import BASE_SPECS, base_spec
from worker.modelzoo.make import MANIFEST, ZooPaths, build_into, file_hashes, is_complete, make_all
from worker.modelzoo.tokenizer import BOS, EOS, IM_END, IM_START, PAD

BASE_NAMES = [spec.name for spec in BASE_SPECS]
PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "    return {key: value for key, value in sorted(mapping.items()) if value is not None}\n",
)
PROMPT_TOKENS = 16
ROUND_TRIP_TEXTS = (
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "héllo wörld, ça va? ñandú",
    "日本語のテキストと中文字符",
    "emoji 🤗🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "e\u0301 decomposed, \u00e9 composed, ﬁ ligature, Ａ fullwidth",
    "zero\x00byte and control \x1b[31m codes",
    "special-looking <|im_end|> and <|end_of_text|> text",
)


def _tokenizer(zoo: ZooPaths, base: str = "tiny") -> PreTrainedTokenizerFast:
    tokenizer = AutoTokenizer.from_pretrained(zoo.base(base))
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    return tokenizer


def _prompt_ids(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    rows = [tokenizer(text)["input_ids"][:PROMPT_TOKENS] for text in PROMPTS]
    assert all(len(row) == PROMPT_TOKENS for row in rows)
    return torch.tensor(rows)


def _greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits and `steps` greedily decoded tokens (with a KV cache, to keep CPU time low)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        prompt_logits = out.logits
        tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(steps - 1):
            out = model(tokens[-1], past_key_values=out.past_key_values, use_cache=True)
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return prompt_logits, torch.cat(tokens, dim=1)


def _load_base(zoo: ZooPaths, name: str) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(zoo.base(name))
    return model.eval()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text_byte_exactly(tiny_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert tiny_tokenizer.decode(tiny_tokenizer(text)["input_ids"]) == text


@pytest.fixture(scope="module")
def tiny_tokenizer(zoo: ZooPaths) -> PreTrainedTokenizerFast:
    return _tokenizer(zoo)


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.text())
def test_tokenizer_round_trips_arbitrary_unicode(tiny_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert tiny_tokenizer.decode(tiny_tokenizer(text)["input_ids"]) == text


def test_tokenizer_adds_no_bos_and_fixes_special_token_ids(zoo: ZooPaths) -> None:
    tokenizer = _tokenizer(zoo)
    assert tokenizer("hello")["input_ids"][0] != tokenizer.bos_token_id
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)
    assert tokenizer.convert_tokens_to_ids([BOS, EOS, PAD, IM_START, IM_END]) == [0, 1, 2, 3, 4]
    assert len(tokenizer) == 8192


def test_chat_template_renders_chatml(zoo: ZooPaths) -> None:
    tokenizer = _tokenizer(zoo)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert isinstance(without_prompt, str) and without_prompt.endswith("Hi!<|im_end|>\n")


@pytest.mark.parametrize("base", BASE_NAMES)
def test_every_tokenizer_loader_gives_the_same_ids(zoo: ZooPaths, base: str) -> None:
    # transformers swaps in its own Qwen2Tokenizer for qwen2 checkpoints; the zoo must agree with it.
    text = "def f(x):\n    return x + 12345  # héllo 🤗 it's <|im_end|>"
    auto = _tokenizer(zoo, base)
    fast = PreTrainedTokenizerFast.from_pretrained(zoo.base(base))
    raw = Tokenizer.from_file(str(zoo.base(base) / "tokenizer.json"))
    ids = auto(text)["input_ids"]
    assert ids == fast(text)["input_ids"] == raw.encode(text).ids
    assert auto.decode(ids) == unicodedata.normalize("NFC", text)
    config = json.loads((zoo.base(base) / "config.json").read_text())
    assert len(auto) == config["vocab_size"]


def test_rebuilding_gives_identical_files(zoo: ZooPaths, tmp_path: Path) -> None:
    bases = ("tiny", "tiny-qwen2")
    for _ in build_into(tmp_path, bases):
        pass
    rebuilt = file_hashes(tmp_path)
    cached = {
        path: digest
        for path, digest in zoo.manifest()["files"].items()
        if path.split("/")[0] in bases or path.split("/")[:2] in (["adapters", b] for b in bases)
    }
    # A mismatch against an older cache means the artefacts changed: bump make.ZOO_VERSION.
    assert rebuilt == cached
    assert {
        "tiny/tokenizer.json",
        "tiny/model.safetensors",
        "adapters/tiny/qv-r8/adapter_model.safetensors",
    } <= (rebuilt.keys())


def test_zoo_layout_and_manifest_match_the_files(zoo: ZooPaths) -> None:
    for spec in BASE_SPECS:
        assert (zoo.base(spec.name) / "model.safetensors").is_file()
        assert zoo.adapter_names(spec.name) == [a.name for a in ADAPTER_SPECS.get(spec.name, ())]
        for name in zoo.adapter_names(spec.name):
            assert (zoo.adapter(spec.name, name) / "adapter_model.safetensors").is_file()
    assert zoo.adapter_names("tiny-mistral") == []
    assert len(zoo.adapter_names("tiny")) >= 8 and len(zoo.adapter_names("small")) >= 8
    assert zoo.manifest()["files"] == file_hashes(zoo.root)


@pytest.mark.parametrize("name", BASE_NAMES)
def test_base_loads_with_transformers(zoo: ZooPaths, name: str) -> None:
    spec = base_spec(name)
    model = _load_base(zoo, name)
    config = model.config
    assert config.model_type == spec.family
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        spec.num_layers,
        spec.hidden_size,
        spec.intermediate_size,
    )
    assert (config.num_attention_heads, config.num_key_value_heads) == (spec.num_heads, spec.num_kv_heads)
    assert config.rope_parameters["rope_theta"] == spec.rope_theta
    assert model.dtype == torch.float32
    assert not torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    generation = json.loads((zoo.base(name) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 4]


def test_qwen2_biases_are_random_not_zero(zoo: ZooPaths) -> None:
    model = _load_base(zoo, "tiny-qwen2")
    biases = {name: p for name, p in model.named_parameters() if name.endswith(".bias")}
    assert {name.split(".")[-2] for name in biases} == {"q_proj", "k_proj", "v_proj"}
    assert all(p.std() > 0.01 for p in biases.values())


@pytest.mark.parametrize("base", sorted(ADAPTER_SPECS))
def test_each_adapter_loads_and_changes_greedy_output(zoo: ZooPaths, base: str) -> None:
    model = _load_base(zoo, base)
    prompts = _prompt_ids(_tokenizer(zoo, base))
    base_logits, base_tokens = _greedy(model, prompts, steps=6)
    for spec in ADAPTER_SPECS[base]:
        adapted = PeftModel.from_pretrained(copy.deepcopy(model), zoo.adapter(base, spec.name)).eval()
        config = adapted.peft_config["default"]
        assert isinstance(config, LoraConfig)
        assert (config.r, config.lora_alpha, config.use_rslora) == (spec.rank, spec.alpha, spec.use_rslora)
        assert set(config.target_modules or ()) == set(spec.targets)
        logits, tokens = _greedy(adapted, prompts, steps=6)
        # Changed, but not blown up: the logit scale stays near the base model's.
        assert 0.7 < (logits.std() / base_logits.std()).item() < 1.4, spec.name
        changed = (tokens != base_tokens).any(dim=1)
        assert changed.float().mean().item() >= 0.8, spec.name


@pytest.mark.parametrize("base", BASE_NAMES)
def test_next_token_depends_on_earlier_context(zoo: ZooPaths, base: str) -> None:
    tokenizer = _tokenizer(zoo, base)
    last = tokenizer("(")["input_ids"][-1]
    prompts = _prompt_ids(tokenizer)
    prompts[:, -1] = last  # same last token, different prefixes
    with torch.no_grad():
        next_ids = _load_base(zoo, base)(prompts).logits[:, -1].argmax(-1)
    assert len(set(next_ids.tolist())) >= len(PROMPTS) // 2


@pytest.mark.parametrize("base", BASE_NAMES)
def test_logits_are_not_flat_and_greedy_does_not_collapse(zoo: ZooPaths, base: str) -> None:
    model = _load_base(zoo, base)
    prompts = _prompt_ids(_tokenizer(zoo, base))
    logits, continuations = _greedy(model, prompts, steps=16)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).median().item() > 0.1
    distinct = [len(set(row.tolist())) for row in continuations]
    assert sum(d > 4 for d in distinct) >= len(PROMPTS) - 1, distinct


def test_make_all_returns_at_once_when_complete(zoo: ZooPaths) -> None:
    manifest = zoo.root / MANIFEST
    before = manifest.stat().st_mtime_ns
    assert make_all(zoo.root, progress=False) == zoo
    assert manifest.stat().st_mtime_ns == before


def test_make_all_serialises_concurrent_builders_and_replaces_leftovers(tmp_path: Path) -> None:
    root = tmp_path / "zoo"
    root.mkdir()
    (root / "junk").write_text("from an interrupted copy")
    (tmp_path / ".zoo.building-stale").mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(make_all, root, False, bases=("tiny-mistral",)) for _ in range(2)]
        results = [future.result(timeout=600) for future in futures]
    assert results == [ZooPaths(root), ZooPaths(root)]
    assert is_complete(root, ("tiny-mistral",))
    assert not (root / "junk").exists()
    assert [p.name for p in tmp_path.iterdir() if ".building-" in p.name] == []
    assert os.stat(root / "tiny-mistral" / "model.safetensors").st_mode & 0o044 == 0o044
