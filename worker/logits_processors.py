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
over the rows that need it and touches only the (row, token) pairs concerned, never whole rows: the pairs
go to the device in one copy per dtype, and nothing is read back.
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
    return tuple(dict.fromkeys((*p.stop_token_ids, *(() if p.ignore_eos else eos_ids))))  # each id once


@dataclass
class _Pairs:
    """(row, token) pairs of one kind, flattened for one host-to-device copy."""

    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, row: int, tokens: list[int] | tuple[int, ...]) -> None:
        self.rows.extend([row] * len(tokens))
        self.tokens.extend(tokens)


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [N, V], one row per sequence of `seqs`. Returns them processed as a float32 copy — or the
    same tensor when no row needs processing (the raw logits are never changed: logprobs read them)."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s, eos_ids)]
    if not rows:
        return logits
    bias, masked, seen, output = _Pairs(), _Pairs(), _Pairs(), _Pairs()
    bias_values: list[float] = []
    for i in rows:
        seq = seqs[i]
        p = seq.request.params
        bias.add(i, [t for t, _ in p.logit_bias])
        bias_values.extend(b for _, b in p.logit_bias)
        masked.add(i, min_tokens_mask(seq, eos_ids))
        if p.repetition_penalty != 1.0:
            seen.add(i, seq.token_ids)  # prompt and output
        if p.presence_penalty or p.frequency_penalty:
            output.add(i, seq.output_token_ids)
    device = str(logits.device)
    parts = [x for pairs in (bias, masked, seen, output) for x in (pairs.rows, pairs.tokens)]
    b_rows, b_toks, m_rows, m_toks, s_rows, s_toks, o_rows, o_toks = pack_int64(parts, device)
    params = [s.request.params for s in seqs]
    floats = host_to_device(
        [
            *bias_values,
            *(p.repetition_penalty for p in params),
            *(p.presence_penalty for p in params),
            *(p.frequency_penalty for p in params),
        ],
        torch.float32,
        device,
    )
    b_vals, repetition, presence, frequency = floats.split([len(bias_values), *[len(seqs)] * 3])
    out = logits.to(torch.float32, copy=True)
    if bias_values:
        out.index_put_((b_rows, b_toks), b_vals, accumulate=True)
    if masked.rows:
        out.index_put_((m_rows, m_toks), out.new_full((), float("-inf")))  # a fill, not a copy
    # Penalties touch only the (row, token) pairs seen, never a whole row. A token seen several times
    # appears several times: each copy computes the same value from the same old one, so writing them all
    # applies the repetition and presence penalties once; the frequency penalty accumulates per copy.
    if seen.rows:
        v, r = out[s_rows, s_toks], repetition[s_rows]
        out[s_rows, s_toks] = torch.where(v > 0, v / r, v * r)
    if output.rows:
        out[o_rows, o_toks] = out[o_rows, o_toks] - presence[o_rows]
        out.index_put_((o_rows, o_toks), -frequency[o_rows], accumulate=True)
    return out
