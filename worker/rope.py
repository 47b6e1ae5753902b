"""Rotary position embeddings, computed exactly as Hugging Face Llama does (fp32 tables, rotate-half)."""

from __future__ import annotations

import math

import torch

from worker.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding:
    """Precomputed cos/sin tables `[max_positions, head_dim]` (`kernels.rope_write_kv` rotates q and k with
    them as it stores k and v)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: str):
        inv = inv_frequencies(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
