"""The GGUF converter's parts, fast and without the real model: the q/k row order llama.cpp permutes is
restored, the streamed safetensors file reads back exactly, names map to Hugging Face's, and what the
converter does not support is refused naming the file and the metadata key. The config's head width and
vocabulary size come from what the weights need, and the tokenizer keeps user-defined tokens whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from worker.hub.gguf_convert import hf_config, hf_name, unpermute_rotary, write_safetensors
from worker.hub.gguf_meta import GGUFConvertError, GGUFMetadata
from worker.hub.gguf_tokenizer import build_tokenizer


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf `LlamaModel.permute`, written out independently.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_rotary_undoes_llama_cpps_permutation(n_head: int) -> None:
    w = np.random.default_rng(n_head).standard_normal((n_head * 64, 48)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rotary(permuted, n_head), w)


def test_the_streamed_safetensors_file_reads_back_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "b.weight": rng.standard_normal((3, 5)),
        "a.weight": rng.standard_normal((7,)),
        "c": np.ones((1,)),
    }
    arrays = {k: v.astype(np.float32) for k, v in tensors.items()}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {k: v.shape for k, v in arrays.items()}, arrays.__getitem__, progress=False)
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(arrays)
        for name, expected in arrays.items():
            assert torch.equal(f.get_tensor(name), torch.from_numpy(expected))


def test_tensor_names_map_to_hugging_face_llama_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(GGUFConvertError, match=r"'blk\.0\.attn_qkv\.weight' has no Hugging Face Llama"):
        hf_name("blk.0.attn_qkv.weight")


def test_unsupported_files_are_refused_naming_the_key() -> None:
    path = Path("m.gguf")
    with pytest.raises(GGUFConvertError, match=r"m.gguf: general.architecture is 'qwen2'"):
        hf_config(GGUFMetadata(path, {"general.architecture": "qwen2"}), has_output=True, vocab_size=4)
    with pytest.raises(GGUFConvertError, match=r"m.gguf: the GGUF metadata has no 'llama.block_count'"):
        hf_config(
            GGUFMetadata(
                path,
                {
                    "general.architecture": "llama",
                    "llama.attention.head_count": 2,
                    "llama.embedding_length": 8,
                    "llama.vocab_size": 4,
                    "llama.feed_forward_length": 16,
                    "tokenizer.ggml.tokens": ["a"],
                },
            ),
            has_output=False,
            vocab_size=4,
        )
    tokenizer = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": ["a"],
    }
    with pytest.raises(GGUFConvertError, match=r"tokenizer.ggml.pre is 'qwen2'; supported: gpt-2, refact, "):
        build_tokenizer(GGUFMetadata(path, tokenizer))
    with pytest.raises(GGUFConvertError, match=r"tokenizer.ggml.model is 'llama'; only byte-level BPE"):
        build_tokenizer(GGUFMetadata(path, {"tokenizer.ggml.model": "llama"}))


def _llama(**fields: object) -> GGUFMetadata:
    """Synthetic metadata of a llama with 4 heads over a 64-wide hidden state (16 wide each)."""
    base: dict[str, object] = {
        "general.architecture": "llama",
        "llama.attention.head_count": 4,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 256,
        "tokenizer.ggml.tokens": ["a", "b", "c"],
    }
    return GGUFMetadata(Path("m.gguf"), {**base, **fields})


def test_the_head_width_is_the_key_length_else_hidden_over_heads_never_the_rotary_width() -> None:
    assert hf_config(_llama(), has_output=True, vocab_size=3)["head_dim"] == 16
    assert hf_config(_llama(**{"llama.rope.dimension_count": 16}), True, 3)["head_dim"] == 16
    wide = {"llama.attention.key_length": 32, "llama.attention.value_length": 32}
    assert hf_config(_llama(**wide), has_output=True, vocab_size=3)["head_dim"] == 32


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"llama.rope.dimension_count": 8}, "llama.rope.dimension_count is 8"),
        (
            {"llama.attention.key_length": 32, "llama.rope.dimension_count": 16},
            "llama.rope.dimension_count is 16",
        ),
        ({"llama.attention.value_length": 8}, "llama.attention.value_length is 8"),
    ],
)
def test_partial_rotary_and_narrow_values_are_refused(fields: dict[str, int], key: str) -> None:
    with pytest.raises(GGUFConvertError, match=rf"m.gguf: {key} but the attention head width is \d+; only a"):
        hf_config(_llama(**fields), has_output=True, vocab_size=3)


def test_the_vocabulary_size_is_the_embeddings_row_count() -> None:
    padded = _llama(**{"llama.vocab_size": 3})  # a padded vocabulary: more embedding rows than tokens
    assert hf_config(padded, has_output=True, vocab_size=8)["vocab_size"] == 8
    with pytest.raises(GGUFConvertError, match=r"holds 3 tokens but token_embd.weight has only 2 rows"):
        hf_config(padded, has_output=True, vocab_size=2)


def _bpe(**fields: object) -> GGUFMetadata:
    tokens = ["a", "b", "<", "t", "o", "l", ">", "<tool>", "<|im_end|>", "ab"]
    base: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 1, 1, 4, 3, 1],
        "tokenizer.ggml.merges": ["a b"],
    }
    return GGUFMetadata(Path("m.gguf"), {**base, **fields})


@pytest.mark.parametrize("pre", [None, "default"])
def test_a_missing_or_default_pre_tokenizer_is_refused_not_split_gpt2_style(pre: str | None) -> None:
    meta = _bpe()
    fields = {k: v for k, v in meta.fields.items() if k != "tokenizer.ggml.pre"}
    if pre is not None:
        fields["tokenizer.ggml.pre"] = pre
    found = "is missing" if pre is None else "is 'default'"
    with pytest.raises(GGUFConvertError, match=rf"m.gguf: tokenizer.ggml.pre {found}.*; supported: gpt-2, "):
        build_tokenizer(GGUFMetadata(meta.path, fields))


def test_user_defined_tokens_are_never_split_and_are_not_special() -> None:
    tokenizer = build_tokenizer(_bpe())
    ids = tokenizer.encode("a<tool>b<|im_end|>ab").ids
    assert ids == [0, 7, 1, 8, 9]
    # Only the control token is special: skipping special tokens keeps the user-defined one.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<tool>bab"
