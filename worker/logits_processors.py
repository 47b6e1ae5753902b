"""What a request's sampling parameters do to its logits before a token is picked: `logit_bias`,
`min_tokens`, and the presence / frequency / repetition penalties.

Applied in vLLM's order, to the raw logits of the step's sampled rows (greedy ones too: their argmax is
taken after), before temperature and the top-k / top-p / min-p filters (`worker.sampler`):

1. `logit_bias`: each (token, bias) pair is added to that token's logit.
2. `min_tokens`: while a request has fewer output tokens than that, its stop token ids and (unless it
   ignores EOS) the model's EOS ids get -inf.
3. `repetition_penalty` r (CTRL's, as transformers and vLLM): every token seen in the prompt or the output
   has its logit divided by r when positive, multiplied by r otherwise.
4. `frequency_penalty` f and `presence_penalty` p (OpenAI's): `logit -= f * count + p * (count > 0)`,
   counting occurrences in the output only.

"Output" includes a resumed request's earlier tokens (`Sequence.output_token_ids`). The work is vectorized
over the rows that need it: their (row, token) pairs go to the device in one copy per dtype, and the
counts are built there by one scatter; nothing is read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.batch import pack_int64
from worker.device import host_to_device
from worker.sequence import Sequence


def needs_processing(seq: Sequence, eos_ids: tuple[int, ...]) -> bool:
    p = seq.request.params
    return bool(p.penalized or p.logit_bias or min_tokens_mask(seq, eos_ids))


def min_tokens_mask(seq: Sequence, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids `seq` may not sample next because it has not reached `min_tokens` yet."""
    p = seq.request.params
    if seq.num_output_tokens >= p.min_tokens:
        return ()
    return (*p.stop_token_ids, *(() if p.ignore_eos else eos_ids))


@dataclass
class _Pairs:
    """(row, token) pairs of one kind, flattened for one host-to-device copy."""

    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, row: int, tokens: list[int] | tuple[int, ...]) -> None:
        self.rows.extend([row] * len(tokens))
        self.tokens.extend(tokens)


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [N, V], one row per sequence of `seqs`. Returns them processed as float32 — the same tensor
    when no row needs it (the raw logits are never changed in place)."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s, eos_ids)]
    if not rows:
        return logits
    device = str(logits.device)
    bias, masked, output, prompt = _Pairs(), _Pairs(), _Pairs(), _Pairs()
    bias_values: list[float] = []
    for j, i in enumerate(rows):
        seq = seqs[i]
        p = seq.request.params
        bias.add(j, [t for t, _ in p.logit_bias])
        bias_values.extend(b for _, b in p.logit_bias)
        masked.add(j, min_tokens_mask(seq, eos_ids))
        if p.penalized:
            output.add(j, seq.output_token_ids)
        if p.repetition_penalty != 1.0:
            prompt.add(j, seq.token_ids[: seq.num_prompt_tokens])
    parts = [rows, *(x for pairs in (bias, masked, output, prompt) for x in (pairs.rows, pairs.tokens))]
    index, b_rows, b_toks, m_rows, m_toks, o_rows, o_toks, p_rows, p_toks = pack_int64(parts, device)
    params = [seqs[i].request.params for i in rows]
    floats = host_to_device(
        [
            *bias_values,
            *(p.repetition_penalty for p in params),
            *(p.frequency_penalty for p in params),
            *(p.presence_penalty for p in params),
        ],
        torch.float32,
        device,
    )
    b_vals, repetition, frequency, presence = floats.split([len(bias_values), *[len(rows)] * 3])
    sub = logits.index_select(0, index).float()
    if bias_values:
        sub.index_put_((b_rows, b_toks), b_vals, accumulate=True)
    if masked.rows:
        sub.index_put_((m_rows, m_toks), torch.tensor(float("-inf"), device=sub.device))
    if output.rows or prompt.rows:
        counts = torch.zeros_like(sub)
        counts.index_put_((o_rows, o_toks), torch.ones_like(o_rows, dtype=sub.dtype), accumulate=True)
        seen = counts > 0
        if prompt.rows:
            seen_any = seen.clone()
            seen_any[p_rows, p_toks] = True
            r = repetition[:, None]
            sub = torch.where(seen_any, torch.where(sub > 0, sub / r, sub * r), sub)
        sub = sub - frequency[:, None] * counts - presence[:, None] * seen
    return logits.float().index_copy(0, index, sub)
