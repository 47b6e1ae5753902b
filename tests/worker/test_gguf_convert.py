"""The GGUF converter's parts, fast and without the real model: the q/k row order llama.cpp permutes is
restored, the streamed safetensors file reads back exactly, names map to Hugging Face's, and what the
converter does not support is refused naming the file and the metadata key."""

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
        hf_config(GGUFMetadata(path, {"general.architecture": "qwen2"}), has_output=True)
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
                },
            ),
            has_output=False,
        )
    tokenizer = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": ["a"],
    }
    with pytest.raises(GGUFConvertError, match=r"tokenizer.ggml.pre 'qwen2' is not supported \(supported: "):
        build_tokenizer(GGUFMetadata(path, tokenizer))
    with pytest.raises(GGUFConvertError, match=r"tokenizer.ggml.model is 'llama'; only byte-level BPE"):
        build_tokenizer(GGUFMetadata(path, {"tokenizer.ggml.model": "llama"}))
