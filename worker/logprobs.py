"""Log-probabilities for the requests that ask for them, and the step's one read of its results.

Values are the model's own: log-softmax of the raw logits in float32, before temperature, penalties, bias
or a grammar (vLLM's default), so they do not depend on how a token was picked. A sampled row reports its
sampled token; a prompt row at position p (`worker.batch.PromptRows`) reports prompt token p + 1. Only
the rows that ask are computed: one `index_select`, one log-softmax and one `topk` (with the largest N
asked for this step) for all of them together. `read_step` brings the sampled tokens and all logprobs
to the host in one copy: the step's only wait for the device.

A prefill chunk may bring thousands of prompt rows; their float32 log-softmax is computed `SLICE_ROWS`
rows at a time, so the extra memory it takes stays bounded (slice × vocabulary), whatever the chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loragate.types import TokenLogprob
from worker.batch import PromptRows, pack_int64
from worker.sequence import Sequence

SLICE_ROWS = 256  # rows log-softmaxed at once: 256 × 49k float32 = 50 MB, twice (values and result)


@dataclass(frozen=True)
class PendingLogprobs:
    """This step's logprobs, still on the device: `asked` sampled rows (row, N) first, then the prompt
    rows of `prompt`, in order. chosen: [M] float32; top_ids, top_logprobs: [M, k], most likely first."""

    asked: list[tuple[int, int]]
    prompt: tuple[PromptRows, ...]
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def gather_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    sampled_seqs: list[Sequence],
    prompt: tuple[PromptRows, ...],
    slice_rows: int = SLICE_ROWS,
) -> PendingLogprobs | None:
    """logits: [S + P, V], the step's sampled rows then its prompt rows; tokens: [S] sampled ids."""
    asked = [(j, n) for j, s in enumerate(sampled_seqs) if (n := s.request.params.logprobs) is not None]
    if not asked and not prompt:
        return None
    num_sampled = len(sampled_seqs)
    rows = [j for j, _ in asked] + list(range(num_sampled, logits.shape[0]))
    targets = [t for r in prompt for t in r.seq.token_ids[r.first + 1 : r.first + 1 + r.count]]
    index, prompt_targets = pack_int64([rows, targets], str(logits.device))
    chosen_ids = torch.cat([tokens.index_select(0, index[: len(asked)]), prompt_targets])
    k = max([n for _, n in asked] + [_prompt_n(r) for r in prompt])
    chosen, top_ids, top_logprobs = [], [], []
    for at in range(0, len(rows), slice_rows):
        logprobs = logits.index_select(0, index[at : at + slice_rows]).float().log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, chosen_ids[at : at + slice_rows, None])[:, 0])
        top = logprobs.topk(k, dim=-1)
        top_ids.append(top.indices)
        top_logprobs.append(top.values)
    return PendingLogprobs(asked, prompt, torch.cat(chosen), torch.cat(top_ids), torch.cat(top_logprobs))


def read_step(
    tokens: torch.Tensor, pending: PendingLogprobs | None
) -> tuple[list[int], list[TokenLogprob | None], list[tuple[PromptRows, list[TokenLogprob]]]]:
    """The sampled token ids; each sampled row's TokenLogprob (None: not asked); each prompt span's."""
    if pending is None:
        return [int(t) for t in tokens.tolist()], [None] * tokens.shape[0], []
    m, k = pending.top_ids.shape
    parts = (tokens, pending.chosen, pending.top_ids.flatten(), pending.top_logprobs.flatten())
    flat = torch.cat([p.double() for p in parts]).tolist()  # token ids < 2**53: exact as doubles
    s = tokens.shape[0]
    token_ids = [int(t) for t in flat[:s]]
    chosen, ids, lps = flat[s : s + m], flat[s + m : s + m + m * k], flat[s + m + m * k :]

    def entry(i: int, token: int, n: int) -> TokenLogprob:
        top = tuple((int(ids[i * k + a]), lps[i * k + a]) for a in range(n))
        return TokenLogprob(token, chosen[i], top)

    sampled: list[TokenLogprob | None] = [None] * s
    for i, (j, n) in enumerate(pending.asked):
        sampled[j] = entry(i, token_ids[j], n)
    spans = []
    i = len(pending.asked)
    for r in pending.prompt:
        targets = r.seq.token_ids[r.first + 1 : r.first + 1 + r.count]
        spans.append((r, [entry(i + a, t, _prompt_n(r)) for a, t in enumerate(targets)]))
        i += r.count
    return token_ids, sampled, spans


def _prompt_n(rows: PromptRows) -> int:
    return rows.seq.request.params.prompt_logprobs or 0
