"""Log-probabilities equal transformers + peft's log-softmax (float32), in one mixed-adapter batch.

Generated tokens' logprobs and top-N, and prompt logprobs, are checked against a teacher-forced HF + peft
forward over the same tokens, for greedy and sampled requests (with penalties and bias, which must not
change the reported values), base and adapter requests of different lengths, under chunked prefill and
under preemption. Prompt logprobs come once, complete, with the first output; their requests compute
their prompts (no prefix-cache hit) but publish the blocks for the requests that follow.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peft import PeftModel

from loragate.types import Request, RequestOutput, SamplingParams, TokenLogprob
from worker.batch import PromptRows, build_forward_batch
from worker.block_manager import BlockManager
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.logprobs import gather_logprobs
from worker.modelzoo.make import ZooPaths
from worker.sequence import Sequence

TOL = 1e-4


def engine_for(zoo: ZooPaths, **overrides: Any) -> LLMEngine:
    adapters = {n: zoo.adapter("tiny", n) for n in zoo.adapter_names("tiny")}
    return LLMEngine(zoo.base("tiny"), EngineConfig(adapters=adapters, **overrides))


def run(engine: LLMEngine, requests: list[Request]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


@torch.inference_mode()
def hf_logprobs(ref: Any, tokens: list[int], adapter: str | None) -> torch.Tensor:
    """[len(tokens), V] float32: row i is HF + peft's log-softmax after tokens[: i + 1]."""
    model = ref.model
    ids = torch.tensor([tokens])
    if adapter is None and isinstance(model, PeftModel):
        with model.disable_adapter():
            logits = model(input_ids=ids).logits[0]
    else:
        if isinstance(model, PeftModel):
            model.set_adapter(adapter)
        logits = model(input_ids=ids).logits[0]
    return logits.float().log_softmax(dim=-1)


def assert_entry(got: TokenLogprob, expected: torch.Tensor, token: int, n: int, where: str) -> None:
    assert got.token_id == token, where
    assert abs(got.logprob - float(expected[token])) < TOL, where
    assert len(got.top) == n, where
    top = expected.topk(n).values.tolist()
    for (tid, lp), ref_lp in zip(got.top, top, strict=True):
        # Compared by value: ids of (near-)tied alternatives may come in either order.
        assert abs(lp - ref_lp) < TOL and abs(lp - float(expected[tid])) < TOL, where
    assert [lp for _, lp in got.top] == sorted((lp for _, lp in got.top), reverse=True), where


def mixed(zoo: ZooPaths, vocab: int, seed: int, n: int = 8) -> list[Request]:
    """Base and adapter requests of different lengths; greedy and sampled, some penalized and biased;
    logprobs and prompt logprobs with various N, and some requests asking for neither."""
    rng = random.Random(seed)
    adapters: list[str | None] = [None, *zoo.adapter_names("tiny")[:4]]
    kinds = [
        {"logprobs": 5, "prompt_logprobs": 3},
        {"logprobs": 0, "temperature": 0.9, "seed": 3, "presence_penalty": 1.0, "logit_bias": ((9, 5.0),)},
        {"prompt_logprobs": 0, "repetition_penalty": 1.3},
        {},
        {"logprobs": 20, "prompt_logprobs": 20, "temperature": 1.2, "top_k": 40, "frequency_penalty": 0.5},
    ]
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(8, vocab) for _ in range(rng.randrange(2, 70)))
        params = SamplingParams(max_tokens=6, ignore_eos=True, **kinds[i % len(kinds)])
        out.append(Request(f"r{seed}-{i}", prompt, params, adapters[i % len(adapters)]))
    return out


def check_against_hf(requests: list[Request], outs: dict[str, list[RequestOutput]], ref: Any) -> None:
    for req in requests:
        got = outs[req.request_id]
        p = req.params
        generated = [t for o in got for t in o.new_token_ids]
        assert len(generated) == p.max_tokens
        expected = hf_logprobs(ref, [*req.prompt_token_ids, *generated], req.adapter)
        prompt_len = len(req.prompt_token_ids)
        logprobs = [lp for o in got for lp in o.logprobs]
        if p.logprobs is None:
            assert not logprobs
        else:
            assert len(logprobs) == len(generated) and all(len(o.logprobs) == 1 for o in got)
            for k, (lp, token) in enumerate(zip(logprobs, generated, strict=True)):
                where = f"{req.request_id} ({req.adapter}) output {k}"
                assert_entry(lp, expected[prompt_len - 1 + k], token, p.logprobs, where)
        # Prompt logprobs come once, with the first output, one per prompt token after the first.
        assert all(not o.prompt_logprobs for o in got[1:])
        prompt_lps = got[0].prompt_logprobs
        if p.prompt_logprobs is None:
            assert not prompt_lps
            continue
        assert len(prompt_lps) == prompt_len - 1
        for i, lp in enumerate(prompt_lps):
            where = f"{req.request_id} ({req.adapter}) prompt {i + 1}"
            assert_entry(lp, expected[i], req.prompt_token_ids[i + 1], p.prompt_logprobs, where)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 12, "max_num_batched_tokens": 48}, id="preemption"),
    ],
)
def test_mixed_adapter_batch_logprobs_equal_hf_peft(
    zoo: ZooPaths, hf_reference: Callable[[str], Any], overrides: dict[str, Any]
) -> None:
    engine = engine_for(zoo, **overrides)
    requests = mixed(zoo, engine.model_config.vocab_size, seed=len(overrides), n=10)
    outs = run(engine, requests)
    assert engine.stats.steps < len(requests) * 6  # they really shared steps
    if "num_kv_blocks" in overrides:
        assert engine.stats.preemptions > 0
    if "max_num_batched_tokens" in overrides:
        assert max(len(r.prompt_token_ids) for r in requests if r.params.prompt_logprobs is not None) > 24
    check_against_hf(requests, outs, hf_reference("tiny"))


def test_prompt_logprobs_skip_the_prefix_cache_but_publish_to_it(zoo: ZooPaths) -> None:
    engine = engine_for(zoo, max_num_batched_tokens=32)
    rng = random.Random(5)
    shared = tuple(rng.randrange(8, 8000) for _ in range(50))
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    echo = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    warm = run(engine, [Request("warm", shared, plain)])["warm"]
    assert warm[-1].cached_tokens == 0
    # The cache holds this prompt's blocks, yet a prompt-logprobs request computes all of it.
    echoed = run(engine, [Request("echo", shared, echo)])["echo"]
    assert echoed[-1].cached_tokens == 0 and len(echoed[0].prompt_logprobs) == 49
    after = run(engine, [Request("after", shared, plain)])["after"]
    assert after[-1].cached_tokens == 48
    # A prompt first seen by a prompt-logprobs request is published for the next one.
    fresh = tuple(rng.randrange(8, 8000) for _ in range(40))
    run(engine, [Request("echo2", fresh, echo)])
    assert run(engine, [Request("next", fresh, plain)])["next"][-1].cached_tokens == 32


def test_resumed_request_gets_no_prompt_logprobs_again(zoo: ZooPaths) -> None:
    engine = engine_for(zoo)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    full = run(engine, [Request("a", (11, 12, 13, 14), params)])["a"]
    first = full[0].new_token_ids
    resumed = run(engine, [Request("b", (11, 12, 13, 14), params, resume_token_ids=first)])["b"]
    assert len(full[0].prompt_logprobs) == 3 and all(not o.prompt_logprobs for o in resumed)
    for again, before in zip(resumed, full[1:], strict=True):  # a prefill now, decodes before
        (lp,), (expected,) = again.logprobs, before.logprobs
        assert lp.token_id == expected.token_id and lp.logprob == pytest.approx(expected.logprob, abs=TOL)


# -- where prompt rows come from: the batch layout and the prefix cache ------------------------------
def echo_seq(n: int, next_logit: int, computed: int, output: int = 0) -> Sequence:
    s = Sequence.from_request(Request("e", tuple(range(10, 10 + n)), SamplingParams(prompt_logprobs=1)))
    s.token_ids.extend([1] * output)
    s.next_prompt_logit, s.num_computed_tokens = next_logit, computed
    s.block_table = list(range(8))
    return s


@pytest.mark.parametrize(
    ("s", "n", "rows", "samples"),
    [
        (echo_seq(20, 0, 0), 8, [(0, 8)], False),  # a first chunk: all its positions
        (echo_seq(20, 8, 8), 12, [(8, 19)], True),  # the last chunk: its last row samples instead
        (echo_seq(20, 12, 4), 12, [(12, 16)], False),  # recomputed after a preemption: no row twice
        (echo_seq(20, 19, 20, output=1), 1, [], True),  # decoding: all prompt logprobs are had
        (echo_seq(1, 0, 0), 1, [], True),  # a one-token prompt has no prompt logprob
    ],
    ids=["first-chunk", "last-chunk", "recompute", "decode", "one-token"],
)
def test_prompt_rows_cover_each_wanted_position_once(
    s: Sequence, n: int, rows: list[tuple[int, int]], samples: bool
) -> None:
    other = echo_seq(30, 29, 30, output=1)  # a decode of another request comes first in the layout
    batch, _, sampled = build_forward_batch([(s, n), (other, 1)], 16, "cpu")
    got = [(r.first, r.first + r.count) for r in batch.prompt_rows]
    assert got == rows
    assert (s in sampled) == samples
    # Logits rows: sampled ones first, then the prompt rows, each the token at its position.
    indices = batch.logits_indices.tolist()
    assert len(indices) == len(sampled) + sum(r.count for r in batch.prompt_rows)
    for r in batch.prompt_rows:
        positions = batch.positions[indices[r.row : r.row + r.count]].tolist()
        assert positions == list(range(r.first, r.first + r.count))


def test_prefix_hits_stop_where_prompt_logits_are_still_wanted() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    cached = Sequence.from_request(Request("c", tuple(range(10, 30))))
    bm.append_slots(cached, 20)
    cached.num_computed_tokens = 20
    bm.commit(cached)
    for next_logit, hit in ((0, 0), (9, 8), (19, 16)):
        s = echo_seq(20, next_logit, 0)
        s.block_table = []
        bm.allocate_prefix(s)
        assert s.num_cached_tokens == hit, next_logit
        bm.free_seq(s)


def test_a_request_aborted_mid_prefill_sends_no_partial_prompt_logprobs(zoo: ZooPaths) -> None:
    engine = engine_for(zoo, max_num_batched_tokens=16)
    engine.add_request(Request("a", tuple(range(10, 60)), SamplingParams(prompt_logprobs=2)))
    assert engine.step() == []  # the first chunk of 16
    assert engine.requests["a"].prompt_logprobs  # some are computed...
    engine.abort("a")
    [out] = engine.step()
    assert out.finished and out.prompt_logprobs == ()  # ...but a partial list never goes out


@pytest.mark.parametrize("slice_rows", [1, 3, 1000], ids=["row-by-row", "uneven-slices", "one-slice"])
def test_prompt_rows_in_slices_give_the_same_logprobs(slice_rows: int) -> None:
    # Two sampled rows (one asking for logprobs), then 7 prompt rows of two sequences.
    def seq(n: int, **kw: Any) -> Sequence:
        return Sequence.from_request(Request("x", tuple(range(1, n + 1)), SamplingParams(max_tokens=4, **kw)))

    a, b, c = seq(5, logprobs=2), seq(3), seq(6, prompt_logprobs=3)
    spans = (PromptRows(a, 0, 3, 2), PromptRows(c, 1, 4, 5))
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 16, generator=rng, dtype=torch.float64).to(torch.bfloat16)
    tokens = torch.tensor([4, 9])
    got = gather_logprobs(logits, tokens, [a, b], spans, slice_rows=slice_rows)
    assert got is not None
    reference = logits[[0, 2, 3, 4, 5, 6, 7, 8]].float().log_softmax(dim=-1)
    targets = [4, 2, 3, 4, 3, 4, 5, 6]  # a's sampled token, then prompt tokens p + 1 of each span
    torch.testing.assert_close(got.chosen, reference[range(8), targets])
    top = reference.topk(3, dim=-1)
    torch.testing.assert_close(got.top_logprobs, top.values)
    assert torch.equal(got.top_ids, top.indices)
