"""Prefix-cache block hashing, shared by the gateway (routing) and the worker (KV reuse).

A block hash is `H(parent_hash, adapter_id, block_token_ids)`: chained, so a hash names the whole prefix
up to the end of its block, and keyed by adapter, because KV computed under adapter A is not valid
under adapter B (LoRA touches the k/v projections). The function must give the same value in every
process, so it uses blake2b rather than Python's salted `hash()`; it imports no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def block_hash(parent: int, adapter_id: str | None, token_ids: Sequence[int]) -> int:
    """The hash of one full block, chained to its parent block's hash (`ROOT_HASH` for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.to_bytes(16, "little"))
    h.update((adapter_id or "").encode())
    h.update(b"\x00")
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, adapter_id: str | None, start: Sequence[int] = ()
) -> list[int]:
    """Hashes of every full block of `token_ids`; `start` holds hashes already known for leading blocks."""
    hashes = list(start)
    parent = hashes[-1] if hashes else ROOT_HASH
    for b in range(len(hashes), len(token_ids) // block_size):
        parent = block_hash(parent, adapter_id, token_ids[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes
