"""Token selection for one step: greedy rows by argmax, the rest by temperature, then min-p / top-k /
top-p filtering, then sampling. The logits it gets are already processed (`worker.logits_processors`).

Each seeded request draws from its own `torch.Generator` on the logits' device, so the same seed gives the
same tokens whatever else shares the batch (on a given device: CPU and CUDA generators are different
algorithms). Sampling uses the exponential race (`argmax(p / E)`, `E ~ Exp(1)`), which is exactly a draw
from `p` and needs one random vector per row. The step's per-row parameters reach the device by
non-blocking copies and the sampled ids come back in one `.tolist()`: the step's only wait for the device.

A request's `seed` may be any signed or unsigned 64-bit integer (clients send either). It reaches the
generator through a hash (`generator_seed`), never directly: torch folds negative seeds onto unsigned ones
(-1 and 2**64-1 would be the same seed) and its CPU generator (mt19937) keeps only the low 32 bits (2**63-1
and 2**64-1 would be too). Hashed, distinct seeds have unrelated streams; two coincide only by chance
(2**-32 for a given pair on the CPU generator), never by a pattern a client is likely to hit.
"""

from __future__ import annotations

import hashlib

import torch

from kernels.glue import argmax_rows
from loragate.types import SamplingParams
from worker.device import host_to_device


def generator_seed(seed: int) -> int:
    """The generator seed for a request's `seed` in [-2**63, 2**64 - 1]: an unsigned 64-bit hash of it."""
    digest = hashlib.blake2b(seed.to_bytes(9, "little", signed=True), digest_size=8, person=b"lg-seed")
    return int.from_bytes(digest.digest(), "little")


def _filter_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    if not any(min_p):
        return logits
    m = host_to_device(min_p, logits.dtype, str(logits.device))[:, None]
    probs = logits.softmax(dim=-1)
    # Relative to the top token's probability (vLLM's min-p): the top token always stays.
    return logits.masked_fill(probs < m * probs.amax(dim=-1, keepdim=True), float("-inf"))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k):
        k = host_to_device([k if 0 < k < vocab else vocab for k in top_k], torch.int64, str(logits.device))
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = host_to_device(top_p, logits.dtype, str(logits.device))[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches p (the top token always stays).
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """logits: [N, V] float; one params / generator per row. Returns one token id per row."""
        return [int(t) for t in self.select(logits, params, generators).tolist()]

    def select(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """`sample` without reading the result: `[N]` int64 token ids on the logits' device."""
        # Greedy rows read the logits as they are: an argmax of 16-bit values is the argmax of their exact
        # fp32 widening, so only the sampled rows are copied to fp32.
        tokens = argmax_rows(logits)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            device = str(logits.device)
            index = host_to_device(rows, torch.int64, device)
            temperatures = host_to_device([params[i].temperature for i in rows], torch.float32, device)
            sub = logits.index_select(0, index).float() / temperatures[:, None]
            sub = _filter_min_p(sub, [params[i].min_p for i in rows])
            sub = _filter_top_k_top_p(sub, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(rows):  # one generator per request: queues a kernel, never waits
                noise[j].exponential_(generator=generators[i])
            tokens.index_copy_(0, index, argmax_rows(probs / noise))
        return tokens
