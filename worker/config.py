"""Model and engine configuration: the parts of a Hugging Face `config.json` the engine needs, validated.

`ModelConfig` is what the engine knows of a model; `worker.models.load_model_config` builds it through the
checkpoint's family (Llama, Qwen2, Mistral: see `worker.models`). Biases are taken from the checkpoint's
tensors, so `attention_bias` / `mlp_bias` variants load too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


class ModelLoadError(ValueError):
    """A checkpoint that the engine cannot load, with the reason."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    # One entry per layer: its sliding window (keys it sees, its own included), or None for full
    # attention. Empty means full attention everywhere.
    layer_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Sliding windows do not shorten it: the attention kernels mask the keys behind a window."""
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every linear a LoRA adapter may target."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs. `num_kv_blocks=None` sizes the KV pool from `kv_cache_bytes`, and that from memory when
    None (`worker.kv_cache.kv_budget`). `device` and `dtype` are
    resolved values (`worker.device` turns the `--device` / `--dtype` specs into them)."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # Commit a CPU KV pool's pages at start rather than at first write (`worker.kv_cache`): `loragate
    # worker` does; off here, so that the many short-lived engines of tests and tools start at once.
    kv_prefault: bool = False
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    host_adapter_bytes: int = 2 * 1024**3
    max_lora_skips: int = 64
    adapters: dict[str, Path] = field(default_factory=dict)
    # Compile the kernels' variants before serving (`worker.warmup`); None: on a CUDA device only (a CPU
    # compiles nothing at first use).
    warmup: bool | None = None
    # Replay whole-decode steps from captured CUDA graphs (`worker.decode_graphs`); None: on a CUDA device
    # with the Triton kernels. True off a GPU runs the same static path uncaptured (the Triton kernels only:
    # tests under the Triton interpreter).
    cuda_graphs: bool | None = None
