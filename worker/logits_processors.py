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
`Sequence`, so it lives and dies with it): its distinct seen tokens and distinct output tokens with their
counts, built from the whole context at first use and then grown with only the tokens appended since,
and its bias and min-tokens ids, uploaded once. A step uploads row indices only, and touches the
(row, token) pairs concerned, at most the vocabulary per row, never whole rows. A preempted sequence
keeps its tokens, so its state stays right.
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
class RequestLogitsState:
    """One request's processor inputs on the device, and on the host what says how to grow them.

    seen_ids: the distinct tokens of the prompt and output (repetition penalty), `seen` their set;
    output_ids / output_counts: the distinct output tokens and how often each occurred (presence and
    frequency), `position` each one's index there; `counted`: how many of the sequence's tokens are in.
    A step touches only these pairs, at most the vocabulary per row, however long the context."""

    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    masked_ids: torch.Tensor
    seen_ids: torch.Tensor | None
    output_ids: torch.Tensor | None
    output_counts: torch.Tensor | None
    seen: set[int] = field(default_factory=set)
    position: dict[int, int] = field(default_factory=dict)
    counted: int = 0

    @classmethod
    def build(cls, seq: Sequence, eos_ids: tuple[int, ...], device: str) -> RequestLogitsState:
        p = seq.request.params
        masked = tuple(dict.fromkeys((*p.stop_token_ids, *(() if p.ignore_eos else eos_ids))))
        bias_ids, masked_ids, empty = pack_int64([[t for t, _ in p.logit_bias], list(masked), []], device)
        bias_values = host_to_device([b for _, b in p.logit_bias], torch.float32, device)
        counting = bool(p.presence_penalty or p.frequency_penalty)
        return cls(
            bias_ids,
            bias_values,
            masked_ids,
            empty if p.repetition_penalty != 1.0 else None,
            empty if counting else None,
            torch.zeros(0, dtype=torch.float32, device=device) if counting else None,
        )

    def news(self, seq: Sequence) -> tuple[list[int], list[int], list[int]]:
        """From the tokens appended since the last step: those never seen, output tokens never output,
        and the `position` of each new output token (to count it); updates the host side."""
        fresh_seen: list[int] = []
        fresh_output: list[int] = []
        positions: list[int] = []
        for at in range(self.counted, seq.num_tokens):
            token = seq.token_ids[at]
            if self.seen_ids is not None and token not in self.seen:
                self.seen.add(token)
                fresh_seen.append(token)
            if self.output_ids is not None and at >= seq.num_prompt_tokens:
                if token not in self.position:
                    self.position[token] = len(self.position)
                    fresh_output.append(token)
                positions.append(self.position[token])
        self.counted = seq.num_tokens
        return fresh_seen, fresh_output, positions

    def grow(self, fresh_seen: torch.Tensor, fresh_output: torch.Tensor, positions: torch.Tensor) -> None:
        """Apply on the device what `news` found (its lists, as device tensors)."""
        if self.seen_ids is not None and len(fresh_seen):
            self.seen_ids = torch.cat([self.seen_ids, fresh_seen])
        if self.output_ids is not None and self.output_counts is not None and len(positions):
            if len(fresh_output):
                self.output_ids = torch.cat([self.output_ids, fresh_output])
                zeros = fresh_output.new_zeros(len(fresh_output), dtype=torch.float32)
                self.output_counts = torch.cat([self.output_counts, zeros])
            self.output_counts.index_add_(0, positions, torch.ones_like(positions, dtype=torch.float32))


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [N, V], one row per sequence of `seqs`. Returns them processed as a float32 copy — or the
    same tensor when no row needs processing (the raw logits are never changed: logprobs read them)."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s, eos_ids)]
    if not rows:
        return logits
    device = str(logits.device)
    states: list[RequestLogitsState] = []
    for i in rows:
        seq = seqs[i]
        if seq.logits_state is None:
            seq.logits_state = RequestLogitsState.build(seq, eos_ids, device)
        states.append(seq.logits_state)
    pairs = list(zip(rows, states, strict=True))
    news = [st.news(seqs[i]) for i, st in pairs]  # usually one token each
    masked = [(i, st) for i, st in pairs if min_tokens_mask(seqs[i], eos_ids)]
    rep = [(i, st) for i, st in pairs if st.seen_ids is not None]
    freq = [(i, st) for i, st in pairs if st.output_ids is not None]
    flat = [[t for n in news for t in n[k]] for k in range(3)]
    t = pack_int64(
        [
            *flat,
            [i for i, st in pairs for _ in range(st.bias_ids.shape[0])],
            [i for i, st in masked for _ in range(st.masked_ids.shape[0])],
            [i for i, _ in rep],
            [len(st.seen) for _, st in rep],
            [i for i, _ in freq],
            [len(st.position) for _, st in freq],
        ],
        device,
    )
    splits = [x.split([len(n[k]) for n in news]) for k, x in enumerate(t[:3])]
    for j, (_, st) in enumerate(pairs):
        st.grow(splits[0][j], splits[1][j], splits[2][j])
    b_rows, m_rows, rep_t, rep_n, freq_t, freq_n = t[3:]
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
    if len(b_rows):
        b_ids = torch.cat([st.bias_ids for st in states])
        b_vals = torch.cat([st.bias_values for st in states])
        out.index_put_((b_rows, b_ids), b_vals, accumulate=True)
    if len(m_rows):
        m_ids = torch.cat([st.masked_ids for _, st in masked])
        out.index_put_((m_rows, m_ids), out.new_full((), float("-inf")))  # a fill, not a copy
    # Only the (row, token) pairs concerned, each distinct token once per row.
    if rep:
        p_rows = rep_t.repeat_interleave(rep_n)
        p_ids = torch.cat([st.seen_ids for _, st in rep if st.seen_ids is not None])
        v, r = out[p_rows, p_ids], repetition.repeat_interleave(rep_n)
        out[p_rows, p_ids] = torch.where(v > 0, v / r, v * r)
    if freq:
        p_rows = freq_t.repeat_interleave(freq_n)
        p_ids = torch.cat([st.output_ids for _, st in freq if st.output_ids is not None])
        counts = torch.cat([st.output_counts for _, st in freq if st.output_counts is not None])
        v = out[p_rows, p_ids] - presence.repeat_interleave(freq_n)
        out[p_rows, p_ids] = v - frequency.repeat_interleave(freq_n) * counts
    return out
