"""The LM head: logits over the vocabulary from final hidden rows, and the greedy pick fused into it.

On a CPU with the native kernels (`kernels.native`), `pack_lm_head` packs a float32 head (or a bfloat16
one that `kernels.linear` widens) once, at load, into column panels of Wᵀ (`kernels/csrc/lm_head_cpu.cpp`):
  - `lm_head_logits` computes the logits from them;
  - `lm_head_argmax` computes each row's greedy token without writing the logits anywhere: a tile's argmax
    is taken while it is in registers. A greedy step thus skips writing and re-reading `[rows, vocab]`
    floats (16 MB for 128 rows of a 32k vocabulary, 25 MB for SmolLM2's 49k).
`python -m loadtest.bench_kernels --backend native` (`lm-head greedy` cases) compares the pick with
oneDNN's matmul plus `argmax_rows`. The sums run over the hidden size in order, so a row's logits never
depend on the batch around it; they equal `F.linear`'s up to float rounding.

A bfloat16 head on a CPU with AMX is `kernels.linear`'s AMX weight (`kernels.linear_amx`), and
`lm_head_argmax` takes each row's pick there as the tiles' sums are rounded (`linear_amx_argmax`).
Anywhere else (CUDA, float16, the `torch` backend, no compiler) the head is `kernels.linear`'s packed
weight, and both functions are `linear` (then `argmax_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import use_native
from kernels.glue import argmax_rows
from kernels.linear import linear, pack_linear_weight, widens
from kernels.linear_amx import AMXWeight, linear_amx_argmax

PANEL = 48  # columns a panel (the kernel's tile width)


@dataclass(frozen=True)
class PackedLMHead:
    """A head in the native CPU kernel's layout: `panels[p, k, c] = W[p * PANEL + c, k]`, zero past
    `vocab`; float32 (a bfloat16 head widened exactly)."""

    panels: torch.Tensor  # [ceil(vocab / PANEL), hidden, PANEL]
    vocab: int

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


LMHead = PackedLMHead | torch.Tensor | AMXWeight


def pack_lm_head(weight: LMHead) -> LMHead:
    """The head in the layout `lm_head_logits` / `lm_head_argmax` run fastest on (a new tensor), or
    `pack_linear_weight(weight)` where the native kernel does not apply.

    Args:
        weight: the LM head (or the tied embedding table).
            Shape: [vocab, hidden]
    """
    if isinstance(weight, PackedLMHead | AMXWeight):
        return weight
    usable = weight.dtype == torch.float32 or widens(weight)
    if not (usable and weight.dim() == 2 and use_native(weight)):  # use_native: built here, backend allows
        return pack_linear_weight(weight)
    vocab, hidden = weight.shape
    num_panels = -(-vocab // PANEL)
    padded = F.pad(weight.float(), (0, 0, 0, num_panels * PANEL - vocab))
    return PackedLMHead(padded.view(num_panels, PANEL, hidden).transpose(1, 2).contiguous(), vocab)


def lm_head_logits(x: torch.Tensor, head: LMHead) -> torch.Tensor:
    """The logits of `x`'s rows (a new tensor, in `x`'s dtype).

    Semantics: `x @ W.T`, W the head `pack_lm_head` packed.

    Args:
        x: final hidden rows.
            Shape: [num_rows, hidden]
        head: from `pack_lm_head`.
    """
    if not isinstance(head, PackedLMHead):
        return linear(x, head)
    out = torch.empty(x.shape[0], head.vocab, dtype=x.dtype)
    if x.shape[0]:
        torch.ops.loragate_cpu.lm_head_logits(out, x.float().contiguous(), head.panels, head.vocab)
    return out


def lm_head_argmax(x: torch.Tensor, head: LMHead) -> torch.Tensor:
    """Each row's greedy token: `argmax_rows(lm_head_logits(x, head))`, without the logits.

    Semantics: the first index of a row's largest logit (as `x`'s dtype rounds it), or of its first NaN
    (torch.argmax's rule).

    Args:
        x: final hidden rows, float32 or bfloat16.
            Shape: [num_rows, hidden]
        head: from `pack_lm_head`.
    Returns:
        int64 token ids.
            Shape: [num_rows]
    """
    if isinstance(head, AMXWeight) and x.dtype == torch.bfloat16:
        return linear_amx_argmax(x, head)
    if not isinstance(head, PackedLMHead) or x.dtype not in (torch.float32, torch.bfloat16):
        return argmax_rows(lm_head_logits(x, head))
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        bf16 = x.dtype == torch.bfloat16
        torch.ops.loragate_cpu.lm_head_argmax(out, x.float().contiguous(), head.panels, head.vocab, bf16)
    return out
