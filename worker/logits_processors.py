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

"Output" includes a resumed request's earlier tokens (`Sequence.output_token_ids`). A step's cost must not
grow with the context: each request keeps its state on the device (`RequestLogitsState`, on its
`Sequence`, so it lives and dies with it): a vocabulary-sized "seen" mask and output-count vector, built
from the whole context at first use and then updated with only the tokens appended since, and its bias
and min-tokens ids, uploaded once. A preempted sequence keeps its tokens, so its state stays right.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class RequestLogitsState:
    """One request's processor inputs on the device. seen: [V] bool, tokens of the prompt and output
    (repetition penalty); counts: [V] float32, occurrences in the output (presence / frequency);
    `counted`: how many of the sequence's tokens are in them."""

    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    masked_ids: torch.Tensor
    seen: torch.Tensor | None
    counts: torch.Tensor | None
    counted: int = 0

    @classmethod
    def build(cls, seq: Sequence, vocab: int, eos_ids: tuple[int, ...], device: str) -> RequestLogitsState:
        p = seq.request.params
        masked = tuple(dict.fromkeys((*p.stop_token_ids, *(() if p.ignore_eos else eos_ids))))
        bias_ids, masked_ids = pack_int64([[t for t, _ in p.logit_bias], list(masked)], device)
        bias_values = host_to_device([b for _, b in p.logit_bias], torch.float32, device)
        seen = torch.zeros(vocab, dtype=torch.bool, device=device) if p.repetition_penalty != 1.0 else None
        counts = None
        if p.presence_penalty or p.frequency_penalty:
            counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        return cls(bias_ids, bias_values, masked_ids, seen, counts)

    def catch_up(self, seq: Sequence, new: torch.Tensor) -> None:
        """Count `new`, the sequence's tokens from `counted` on (as a device tensor)."""
        if self.seen is not None:
            self.seen[new] = True
        if self.counts is not None:
            output = new[max(0, seq.num_prompt_tokens - self.counted) :]
            self.counts.index_add_(0, output, torch.ones_like(output, dtype=torch.float32))
        self.counted = seq.num_tokens


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [N, V], one row per sequence of `seqs`. Returns them processed as a float32 copy — or the
    same tensor when no row needs processing (the raw logits are never changed: logprobs read them)."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s, eos_ids)]
    if not rows:
        return logits
    device, vocab = str(logits.device), logits.shape[1]
    states: list[RequestLogitsState] = []
    for i in rows:
        seq = seqs[i]
        if seq.logits_state is None:
            seq.logits_state = RequestLogitsState.build(seq, vocab, eos_ids, device)
        states.append(seq.logits_state)
    # The tokens appended since each state's last step (usually one), and the row indices, in one copy.
    pairs = list(zip(rows, states, strict=True))
    news = [seqs[i].token_ids[st.counted :] for i, st in pairs]
    masked = [(i, st) for i, st in pairs if min_tokens_mask(seqs[i], eos_ids)]
    bias_rows = [i for i, st in pairs for _ in range(st.bias_ids.shape[0])]
    mask_rows = [i for i, st in masked for _ in range(st.masked_ids.shape[0])]
    rep = [(i, st.seen) for i, st in pairs if st.seen is not None]
    freq = [(i, st.counts) for i, st in pairs if st.counts is not None]
    flat_news = [t for n in news for t in n]
    new_t, b_rows, m_rows, rep_t, freq_t = pack_int64(
        [flat_news, bias_rows, mask_rows, [i for i, _ in rep], [i for i, _ in freq]], device
    )
    for (i, st), new in zip(pairs, new_t.split([len(n) for n in news]), strict=True):
        if len(new):
            st.catch_up(seqs[i], new)
    params = [seqs[i].request.params for i in rows]
    floats = host_to_device(
        [
            *(p.repetition_penalty for p in params if p.repetition_penalty != 1.0),
            *(p.presence_penalty for p in params if p.presence_penalty or p.frequency_penalty),
            *(p.frequency_penalty for p in params if p.presence_penalty or p.frequency_penalty),
        ],
        torch.float32,
        device,
    )
    repetition, presence, frequency = floats.split([len(rep), len(freq), len(freq)])
    out = logits.to(torch.float32, copy=True)
    if bias_rows:
        b_ids = torch.cat([st.bias_ids for st in states])
        b_vals = torch.cat([st.bias_values for st in states])
        out.index_put_((b_rows, b_ids), b_vals, accumulate=True)
    if mask_rows:
        m_ids = torch.cat([st.masked_ids for _, st in masked])
        out.index_put_((m_rows, m_ids), out.new_full((), float("-inf")))  # a fill, not a copy
    # Whole rows of the vocabulary, but only those of penalized requests: O(V) per row, whatever the context.
    if rep:
        v, r = out[rep_t], repetition[:, None]
        factor = torch.where(v > 0, 1 / r, r).masked_fill_(~torch.stack([s for _, s in rep]), 1.0)
        out[rep_t] = v.mul_(factor)
    if freq:
        counts = torch.stack([c for _, c in freq])
        v = out[freq_t].sub_(presence[:, None] * (counts > 0))
        out[freq_t] = v.sub_(frequency[:, None] * counts)
    return out
