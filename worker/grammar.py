"""Structured outputs in the engine: each guided request's grammar, enforced on its own logits row.

A request's `SamplingParams.guide` (a `loragate.guides.Guide`) is compiled by xgrammar into a grammar over
the model's tokens, and the request gets its own `GrammarMatcher` (replayed over any resumed tokens).
Every step, `mask` fills the next-token bitmasks of the batch's guided rows in one
`BatchGrammarMatcher` call and sets every token the grammar forbids to -inf, before sampling; rows
without a guide pay nothing, and a batch without one costs a list scan. `accept` advances a row's matcher
by the token sampled and says when the guide is done: the grammar is complete and allows nothing but a
stop token, so the request finishes (STOP) without spending a step on the EOS it would be forced to
pick. A complete grammar that may still go on (`[0-9]+`) leaves the choice to the model: EOS then ends
it like any request.

What each kind compiles to, and which guides are refused: `worker.grammar_compile`. A guide that cannot
be honoured raises ValueError in `compile` (the service answers 400). Compiling is split from starting a
request's matcher: `compile` is thread-safe (xgrammar's compiler is, and releases the GIL while it works),
so a worker compiles a new guide on threads of its own (`worker.service_compiles`) — 1–10 ms for a typical
schema, seconds for a big one, which on the step thread would stall every running sequence — and adds the
request with its compiled grammar; `LLMEngine.add_request` compiles on its caller's thread when given none.

xgrammar (it imports transformers: ~1 s) and its tokenizer tables (~0.4 s on a 49k vocabulary) are not
loaded with the engine: a worker service loads them on a background thread as it starts (`warm`), so the
first guided request does not stall the running ones; an engine used alone loads them on its first.
The tables cover the model's logits width (config `vocab_size`, which may exceed the tokenizer's), with
the model's EOS ids as the stop tokens. Compiled grammars are cached (bounded, `worker.grammar_cache`), keyed
by the guide's text.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loragate.guides import Guide
from loragate.types import Request, SamplingParams
from worker.device import is_cuda
from worker.grammar_cache import GrammarCache
from worker.grammar_compile import compile_guide

if TYPE_CHECKING:
    import xgrammar as xgr

    from worker.engine_requests import Tracked

log = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20  # compiled grammars kept, at most: clients send arbitrary schemas


@dataclass
class GrammarStats:
    """Host time spent on guides (on CUDA the mask's apply is queued, not waited on); only grows."""

    mask_seconds: float = 0.0  # filling and applying masks
    mask_steps: int = 0  # steps with at least one guided row
    mask_rows: int = 0
    accept_seconds: float = 0.0  # advancing matchers (and checking whether they are done)
    accepted: int = 0


class GuidedDecoding:
    """The engine's grammar side: compile guides (`compile`, from any thread), start a request's matcher
    (`start`), mask guided rows, advance their matchers."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...], device: str):
        self.tokenizer_file = model_dir / "tokenizer.json"
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.stats = GrammarStats()
        self.cache = GrammarCache(CACHE_BYTES)
        self._loading = threading.Lock()  # one thread loads xgrammar and the tables; the others wait

    def warm(self) -> None:
        """Load xgrammar and the tokenizer tables now; safe from any thread (a guided request arriving
        meanwhile waits for this rather than loading them a second time)."""
        with self._loading:
            _ = self._compiler, self._batcher

    @property
    def is_warm(self) -> bool:
        return "_compiler" in self.__dict__ and "_batcher" in self.__dict__

    # -- requests ---------------------------------------------------------------------------------
    def compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar of `params`' guide (None without one), from the cache or compiled now.
        Safe from any thread (the worker's compile threads call it); raises ValueError, with the message
        for the client, if the guide is not one, does not compile, or cannot be honoured."""
        if not params.guide:
            return None
        guide = Guide.from_json(params.guide)
        if params.ignore_eos:
            # The matcher ends the output where the grammar does (EOS is then its only token): it cannot
            # also be made to run on to max_tokens.
            raise ValueError("ignore_eos cannot be combined with a structured-output guide")
        compiled = self.cache.get(params.guide)
        if compiled is None:
            with self._loading:
                compiler = self._compiler
            compiled = compile_guide(compiler, guide)
            self.cache.put(params.guide, compiled, compiled.memory_size_bytes)
        return compiled

    def is_compiled(self, params: SamplingParams) -> bool:
        """True when `params`' guide is in the cache: `compile` then costs only a JSON parse."""
        return params.guide in self.cache

    def start(
        self, request: Request, compiled: xgr.CompiledGrammar | None = None
    ) -> xgr.GrammarMatcher | None:
        """The matcher for `request`'s guide, replayed over its resumed tokens; None without a guide.
        `compiled` is its guide's grammar from `compile` (compiled now if not given). Raises ValueError
        as `compile` does, or if the resumed tokens break the guide."""
        if not request.params.guide:
            return None
        if compiled is None:
            compiled = self.compile(request.params)
        matcher = self._xgr.GrammarMatcher(compiled)
        for token in request.resume_token_ids:
            if not matcher.accept_token(token):
                raise ValueError("the resumed tokens do not follow the request's structured-output guide")
        return matcher

    def mask(self, logits: torch.Tensor, tracked: list[Tracked]) -> torch.Tensor:
        """`logits` ([N, V], row i for tracked[i]) with every token the row's guide forbids set to -inf:
        a new tensor when a row is guided (the raw logits stay for log-probabilities), else `logits`."""
        rows = [i for i, t in enumerate(tracked) if t.matcher is not None]
        if not rows:
            return logits
        start = time.perf_counter()
        bitmask = self._bitmask(len(tracked))
        matchers = [m for m in (tracked[i].matcher for i in rows) if m is not None]
        self._batcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        if logits.device.type == "cpu":
            masked = _apply_on_host(logits, bitmask, rows)
        else:
            masked = logits.clone()
            device_mask = bitmask[: len(tracked)].to(logits.device, non_blocking=True)
            self._xgr.apply_token_bitmask_inplace(
                masked, device_mask, vocab_size=logits.shape[-1], indices=rows
            )
        self.stats.mask_seconds += time.perf_counter() - start
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)
        return masked

    def accept(self, t: Tracked, token: int) -> bool:
        """Advance `t`'s matcher by `token`; True when its guide is done (the request should finish)."""
        m = t.matcher
        if m is None:
            return False
        start = time.perf_counter()
        if m.accept_token(token):
            done = m.is_terminated() or (m.is_completed() and self._only_stop_left(m))
        else:
            # The mask allowed only tokens the grammar accepts: this is a bug, and the matcher cannot go on.
            log.error("request %s: token %d broke its guide; finishing it", t.seq.request_id, token)
            done = True
        self.stats.accept_seconds += time.perf_counter() - start
        self.stats.accepted += 1
        return done

    # -- internals --------------------------------------------------------------------------------
    def _only_stop_left(self, m: xgr.GrammarMatcher) -> bool:
        """True when the grammar allows nothing but a stop token next."""
        row = self._scratch
        m.fill_next_token_bitmask(row)
        return not bool((row & self._non_stop).any())

    def _bitmask(self, n: int) -> torch.Tensor:
        if self._host_bitmask.shape[0] < n:
            self._host_bitmask = self._allocate(n)
        return self._host_bitmask

    def _allocate(self, n: int) -> torch.Tensor:
        bitmask = self._xgr.allocate_token_bitmask(max(n, 1), self.vocab_size)
        # Pinned, so the copy to the device is asynchronous; it is done before the next fill, as each step
        # waits for its sampled tokens.
        return bitmask.pin_memory() if is_cuda(self.device) else bitmask

    @cached_property
    def _xgr(self) -> Any:
        import xgrammar

        return xgrammar

    @cached_property
    def _compiler(self) -> xgr.GrammarCompiler:
        import transformers

        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_file))
        info = self._xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids)
        )
        return self._xgr.GrammarCompiler(info, cache_enabled=False)  # `self.cache` keeps them

    @cached_property
    def _batcher(self) -> xgr.BatchGrammarMatcher:
        return self._xgr.BatchGrammarMatcher()

    @cached_property
    def _host_bitmask(self) -> torch.Tensor:
        return self._allocate(1)

    @cached_property
    def _scratch(self) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(1, self.vocab_size)[0]

    @cached_property
    def _non_stop(self) -> torch.Tensor:
        """The bitmask of every real token but the stop tokens."""
        allowed = torch.zeros(self._scratch.numel() * 32, dtype=torch.bool)
        allowed[: self.vocab_size] = True
        allowed[list(self.eos_token_ids)] = False
        return pack_bits(allowed)


def _apply_on_host(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits` with the forbidden tokens of `rows` at -inf, on the CPU. xgrammar's own CPU kernel tests
    bit by bit (~5 ms for 32 x 49k logits); numpy's unpackbits and one `torch.where` take ~1 ms."""
    vocab = logits.shape[-1]
    packed = bitmask[rows].numpy().view(np.uint8)  # little-endian int32 words: token 32w + j is bit j
    allowed = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].view(np.bool_))
    if len(rows) == logits.shape[0]:
        return torch.where(allowed, logits, float("-inf"))
    index = torch.tensor(rows)
    masked = logits.clone()
    masked[index] = torch.where(allowed, logits[index], float("-inf"))
    return masked


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A bool vector (length a multiple of 32) as xgrammar's int32 bitmask: bit j of word w is token
    32 * w + j."""
    words = bits.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    packed = words.sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
