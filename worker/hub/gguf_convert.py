"""Convert a llama-architecture GGUF file (llama.cpp's format) into a Hugging Face checkpoint directory.

The file is read with llama.cpp's own `gguf` package: `config.json` and `generation_config.json` come
from its `llama.*` and `tokenizer.ggml.*` metadata, the tokenizer files from `gguf_tokenizer`, and the
weights are dequantized to float32 and streamed tensor by tensor into `model.safetensors` under
Hugging Face names, so peak memory stays near one tensor, not the whole model. llama.cpp's converter
permutes the rows of every q/k projection to suit its interleaved (GPT-J style) rotary embedding; they
are permuted back here to the half-split layout Hugging Face's Llama (and our engine) uses. A file
without `output.weight` shares its embedding with the LM head (`tie_word_embeddings`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from worker.hub.gguf_meta import GGUFConvertError, GGUFFileReader, GGUFMetadata, read_metadata
from worker.hub.gguf_tokenizer import write_tokenizer

# Bump when the converted files change, so an old conversion in the cache is redone.
CONVERTER_VERSION = 1

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _short_float(value: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.999999747378752e-06; keep the shortest equal float32.
    return float(str(np.float32(value)))


def hf_config(meta: GGUFMetadata, has_output: bool, vocab_size: int) -> dict[str, Any]:
    """`config.json` for a `LlamaForCausalLM` described by `meta`, whose embedding has `vocab_size` rows.

    The vocabulary size is the embedding's, not the tokenizer's: a padded vocabulary has more rows than
    tokens. The head width is `llama.attention.key_length` (else hidden / heads), never the rotary width
    `llama.rope.dimension_count`, which is smaller under partial rotary (not supported, so refused).
    """
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise GGUFConvertError(f"{meta.path}: general.architecture is {arch!r}; only 'llama' is supported")
    if meta.get("llama.rope.scaling.type") not in (None, "none"):
        raise GGUFConvertError(
            f"{meta.path}: rope scaling {meta.get('llama.rope.scaling.type')!r} is not supported"
        )
    heads = int(meta.require("llama.attention.head_count"))
    hidden = int(meta.require("llama.embedding_length"))
    head_dim = _head_dim(meta, hidden, heads)
    tokens = len(meta.require("tokenizer.ggml.tokens"))
    if tokens > vocab_size:
        raise GGUFConvertError(
            f"{meta.path}: tokenizer.ggml.tokens holds {tokens} tokens but token_embd.weight has only "
            f"{vocab_size} rows"
        )
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _short_float(meta.require("llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.require("llama.context_length")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": _short_float(meta.get("llama.rope.freq_base", 10000.0)),
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_output,
        "dtype": "float32",
    }
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


def _head_dim(meta: GGUFMetadata, hidden: int, heads: int) -> int:
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    for key in ("llama.attention.value_length", "llama.rope.dimension_count"):
        width = meta.get(key)
        if width is not None and int(width) != head_dim:
            raise GGUFConvertError(
                f"{meta.path}: {key} is {int(width)} but the attention head width is {head_dim}; "
                "only a rotary embedding over the whole head, with values as wide as keys, is supported"
            )
    return head_dim


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a llama.cpp tensor name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise GGUFConvertError(f"tensor {gguf_name!r} has no Hugging Face Llama counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rotary(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, interleaved (x0, y0, x1, y1, …) → halves (x…, y…).

    llama.cpp's converter maps `[n_head, 2, d/2, …]` to `[n_head, d/2, 2, …]` (a swap of axes 1 and 2);
    the same swap on the permuted shape restores the original.
    """
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _dequantized(tensor: gguf.ReaderTensor, config: dict[str, Any]) -> np.ndarray:
    # GGUF lists dimensions fastest-first; numpy (and torch) want them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    values = values.reshape(shape)
    if tensor.name.endswith(".attn_q.weight"):
        values = unpermute_rotary(values, config["num_attention_heads"])
    elif tensor.name.endswith(".attn_k.weight"):
        values = unpermute_rotary(values, config["num_key_value_heads"])
    return np.ascontiguousarray(values)


def write_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], tensors: Callable[[str], np.ndarray], progress: bool
) -> None:
    """Write float32 tensors `shapes` to `path` as safetensors, getting each by name only to write it.

    The header (names, shapes, byte offsets) is known before any data, so the file is streamed.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data must start 8-byte aligned
    with path.open("wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for name in tqdm(shapes, desc="converting", unit="tensor", disable=not progress):
            values = tensors(name)
            if values.shape != shapes[name] or values.dtype != np.float32:
                raise GGUFConvertError(
                    f"{name}: got {values.dtype}{values.shape}, expected float32{shapes[name]}"
                )
            out.write(values.astype("<f4", copy=False).tobytes())


def convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write an HF Llama checkpoint for `gguf_path` into the existing (empty) directory `out_dir`."""
    reader = GGUFFileReader(gguf_path)
    meta = read_metadata(reader, gguf_path)
    by_name = {hf_name(t.name): t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in by_name.items()}
    if "model.embed_tokens.weight" not in shapes:
        raise GGUFConvertError(f"{gguf_path}: the file has no token_embd.weight tensor")
    vocab_size = shapes["model.embed_tokens.weight"][0]
    config = hf_config(meta, has_output="lm_head.weight" in by_name, vocab_size=vocab_size)
    write_safetensors(
        out_dir / "model.safetensors", shapes, lambda name: _dequantized(by_name[name], config), progress
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos_ids = write_tokenizer(meta, out_dir)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos_ids}
    if "pad_token_id" in config:
        generation["pad_token_id"] = config["pad_token_id"]
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
