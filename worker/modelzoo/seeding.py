"""Deterministic random tensors keyed by name, for building the zoo's weights.

Each tensor draws from its own generator, seeded from a stable hash of a string key (the model or
adapter seed plus the parameter name). So a weight's value depends neither on the order in which
modules are created nor on the global torch RNG that transformers and peft consume while building,
and a rebuild gives the same bytes.
"""

from __future__ import annotations

import zlib

import torch


def key_seed(key: str) -> int:
    """A stable 32-bit seed for `key` (Python's `hash` is salted per process, CRC32 is not)."""
    return zlib.crc32(key.encode("utf-8"))


def seeded_normal(
    shape: torch.Size | tuple[int, ...], key: str, std: float, mean: float = 0.0
) -> torch.Tensor:
    """A float32 tensor of `shape` drawn from N(mean, std²), the same for the same `key` every time."""
    generator = torch.Generator(device="cpu").manual_seed(key_seed(key))
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * std + mean
