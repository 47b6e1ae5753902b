"""Every sampling parameter does what it says: each logits processor against a hand-computed reference
(alone and batched with others), min-p in the sampler, and the engine end to end — greedy requests follow
penalties and bias, min_tokens holds off EOS, stop tokens and stop strings, seeded sampling with penalties
is reproducible, out-of-vocabulary ids are refused, and a worker streams logprobs to Redis.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch
from peft import PeftModel

from loragate.messages import QueuedRequest
from loragate.types import Request, RequestOutput, SamplingParams
from tests.worker.test_service import collect, enqueue, start
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.logits_processors import process_logits
from worker.modelzoo.make import ZooPaths
from worker.sampler import Sampler
from worker.sequence import Sequence

EOS = (7,)
LOGITS = [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, 3.0]  # V = 8; token 7 is EOS
INF = float("inf")


def seq(
    prompt: tuple[int, ...], output: tuple[int, ...] = (), resumed: tuple[int, ...] = (), **kw: Any
) -> Sequence:
    s = Sequence.from_request(
        Request("x", prompt, SamplingParams(max_tokens=16, **kw), resume_token_ids=resumed)
    )
    s.token_ids.extend(output)
    return s


def plus(base: list[float], **changes: float) -> list[float]:
    out = list(base)
    for k, v in changes.items():
        out[int(k[1:])] = v
    return out


CASES = [
    ("none", seq((1, 2)), LOGITS),
    ("logit-bias", seq((1,), logit_bias=((2, 3.0), (6, -100.0))), plus(LOGITS, t2=3.5, t6=-96.0)),
    (
        "min-tokens-masks-eos-and-stop-ids",
        seq((1,), (3,), min_tokens=2, stop_token_ids=(4,)),
        plus(LOGITS, t4=-INF, t7=-INF),
    ),
    ("min-tokens-reached", seq((1,), (3, 3), min_tokens=2, stop_token_ids=(4,)), LOGITS),
    (
        "min-tokens-ignore-eos",
        seq((1,), min_tokens=1, stop_token_ids=(4,), ignore_eos=True),
        plus(LOGITS, t4=-INF),
    ),
    ("presence", seq((0,), (1, 1, 6), presence_penalty=0.5), plus(LOGITS, t1=-1.5, t6=3.5)),
    ("frequency", seq((0,), (1, 1, 6), frequency_penalty=0.5), plus(LOGITS, t1=-2.0, t6=3.5)),
    (
        "negative-penalties",
        seq((0,), (1, 1), presence_penalty=-1.0, frequency_penalty=-0.5),
        plus(LOGITS, t1=1.0),
    ),
    # Divided when positive, multiplied when not; prompt tokens count too (0 and 3), unseen ones do not.
    (
        "repetition",
        seq((0, 3), (5, 6), repetition_penalty=2.0),
        plus(LOGITS, t0=1.0, t3=-6.0, t5=0.0, t6=2.0),
    ),
    ("repetition-below-one", seq((1,), repetition_penalty=0.5), plus(LOGITS, t1=-0.5)),
    # Bias first, then penalties (vLLM's order): 6 is biased to 4 - 6 = -2, then multiplied by 2.
    (
        "bias-then-repetition",
        seq((6,), logit_bias=((6, -6.0),), repetition_penalty=2.0),
        plus(LOGITS, t6=-4.0),
    ),
    ("resumed-tokens-are-output", seq((0,), resumed=(2,), presence_penalty=1.0), plus(LOGITS, t2=-0.5)),
    (
        "all-at-once",
        seq(
            (4,),
            (2, 2),
            presence_penalty=1.0,
            frequency_penalty=0.25,
            repetition_penalty=2.0,
            logit_bias=((0, 1.0),),
            min_tokens=3,
        ),
        plus(LOGITS, t0=3.0, t2=0.5 / 2 - 0.25 * 2 - 1.0, t4=0.5, t7=-INF),
    ),
]


@pytest.mark.parametrize(("s", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_processor_matches_hand_computed_logits(s: Sequence, expected: list[float]) -> None:
    raw = torch.tensor([LOGITS])
    before = raw.clone()
    out = process_logits(raw, [s], EOS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([expected]))
    assert torch.equal(raw, before)  # the raw logits (logprobs read them) are never changed


def test_processors_batched_equal_each_row_alone() -> None:
    seqs = [c[1] for c in CASES]
    rng = torch.Generator().manual_seed(0)
    raw = torch.randn(len(seqs), 8, generator=rng)
    together = process_logits(raw, seqs, EOS)
    alone = torch.cat([process_logits(raw[i : i + 1], [s], EOS) for i, s in enumerate(seqs)])
    torch.testing.assert_close(together, alone)


def test_processor_state_kept_across_steps_equals_a_fresh_build() -> None:
    # Each request's device state is built once and then updated with new tokens only; rows move between
    # steps. After every step it must give what a sequence seen for the first time gives.
    kw: list[dict[str, Any]] = [
        dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25),
        dict(frequency_penalty=0.5, min_tokens=3, stop_token_ids=(4, 4, 7), logit_bias=((2, 1.0), (2, 0.5))),
        dict(repetition_penalty=0.8),
    ]
    live = [seq((1, 2), resumed=(3, 3), **k) for k in kw]
    rnd = random.Random(0)
    rng = torch.Generator().manual_seed(0)
    for _ in range(6):
        rnd.shuffle(live)
        raw = torch.randn(len(live), 8, generator=rng)
        fresh = [seq(tuple(s.token_ids[: s.num_prompt_tokens]), **kw_of(s)) for s in live]
        for f, s in zip(fresh, live, strict=True):
            f.token_ids[:] = s.token_ids
        torch.testing.assert_close(process_logits(raw, live, EOS), process_logits(raw, fresh, EOS))
        for s in live:
            s.token_ids.append(rnd.randrange(8))


def kw_of(s: Sequence) -> dict[str, Any]:
    p = s.request.params
    names = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids")
    return {n: getattr(p, n) for n in names} | {"logit_bias": p.logit_bias}


@pytest.mark.parametrize(
    ("min_p", "allowed"),
    [(0.0, {0, 4, 6, 7}), (0.3, {6, 7}), (0.5, {6}), (1.0, {6})],
    ids=["off", "two-left", "top-only", "max"],
)
def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability(min_p: float, allowed: set[int]) -> None:
    # Token 6's logit is 4, 7's is 3: p7 / p6 = e**-1 ≈ 0.37; the next (0, logit 2) is e**-2 ≈ 0.14.
    params = [SamplingParams(temperature=1.0, min_p=min_p)] * 400
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    drawn = set(Sampler().sample(torch.tensor([LOGITS] * 400), params, list(gens)))
    assert drawn == allowed if min_p else drawn >= allowed  # off: even a 3% token comes up


# -- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(zoo: ZooPaths) -> LLMEngine:
    adapters = {n: zoo.adapter("tiny", n) for n in zoo.adapter_names("tiny")}
    return LLMEngine(zoo.base("tiny"), EngineConfig(adapters=adapters, num_kv_blocks=256))


def prompt(seed: int, n: int = 20) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(8, 8000) for _ in range(n))


def run(engine: LLMEngine, *requests: Request) -> dict[str, list[RequestOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@torch.inference_mode()
def hf_greedy_with(
    ref: Any, ids: list[int], adapter: str | None, n: int, params: SamplingParams
) -> list[int]:
    """HF + peft greedy decoding with `params`' penalties and bias applied by hand (torch, no engine code)."""
    model, prompt_len, out = ref.model, len(ids), list(ids)
    if isinstance(model, PeftModel) and adapter is not None:
        model.set_adapter(adapter)
    for _ in range(n):
        if isinstance(model, PeftModel) and adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=torch.tensor([out])).logits[0, -1].float()
        else:
            logits = model(input_ids=torch.tensor([out])).logits[0, -1].float()
        for t, b in params.logit_bias:
            logits[t] += b
        generated = out[prompt_len:]
        seen = set(out)
        r = params.repetition_penalty
        for t in seen:
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        for t in set(generated):
            logits[t] -= params.frequency_penalty * generated.count(t) + params.presence_penalty
        out.append(int(logits.argmax()))
    return out[prompt_len:]


@pytest.mark.parametrize(
    "params",
    [
        # Penalties that favour repeats: the tiny model's greedy output has none, so others change nothing.
        SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=0.3),
        SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=-1.5, frequency_penalty=-0.7),
        SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=((100, 8.0), (200, 7.5))),
    ],
    ids=["repetition", "presence-frequency", "logit-bias"],
)
def test_greedy_requests_follow_penalties_and_bias_like_hf(
    engine: LLMEngine, zoo: ZooPaths, hf_reference: Callable[[str], Any], params: SamplingParams
) -> None:
    names: list[str | None] = [None, *zoo.adapter_names("tiny")[:2]]
    reqs = [Request(f"g{i}", prompt(30 + i, 10 + 7 * i), params, a) for i, a in enumerate(names)]
    plain = dataclasses.replace(
        params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=()
    )
    outs = run(
        engine, *reqs, *[dataclasses.replace(r, request_id=r.request_id + "p", params=plain) for r in reqs]
    )
    ref = hf_reference("tiny")
    for r in reqs:
        got = tokens(outs[r.request_id])
        assert got == hf_greedy_with(ref, list(r.prompt_token_ids), r.adapter, 12, params), r.request_id
        assert got != tokens(outs[r.request_id + "p"]), "the parameters changed nothing"


def test_seeded_sampling_with_penalties_is_reproducible(engine: LLMEngine) -> None:
    params = SamplingParams(
        max_tokens=16,
        temperature=1.0,
        top_p=0.95,
        min_p=0.02,
        seed=2**64 - 1,
        ignore_eos=True,
        presence_penalty=-0.8,  # favouring repeats: the tiny model makes none of its own
        frequency_penalty=-0.4,
        repetition_penalty=0.6,
        logit_bias=((42, 3.0),),
    )
    alone = tokens(run(engine, Request("s1", prompt(9), params))["s1"])
    crowd = [Request(f"c{i}", prompt(50 + i), dataclasses.replace(params, seed=i)) for i in range(4)]
    shared = tokens(run(engine, *crowd, Request("s2", prompt(9), params, "qv-r8"))["s2"])
    again = tokens(run(engine, Request("s3", prompt(9), params, "qv-r8"), *crowd[:2])["s3"])
    unpenalized = dataclasses.replace(
        params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0
    )
    other = tokens(run(engine, Request("s4", prompt(9), unpenalized, "qv-r8"))["s4"])
    assert shared == again and len(shared) == 16
    assert shared != other and alone != shared  # the penalties and the adapter matter


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings(engine: LLMEngine) -> None:
    free = tokens(run(engine, Request("f", prompt(3), SamplingParams(max_tokens=12, ignore_eos=True)))["f"])
    text = engine.tokenizer.decode(free)
    original = engine.model_config
    engine.model_config = dataclasses.replace(original, eos_token_ids=(free[1],))
    try:
        eos = run(engine, Request("e", prompt(3), SamplingParams(max_tokens=12, min_tokens=6)))["e"]
    finally:
        engine.model_config = original
    assert free[1] not in tokens(eos)[:6] and len(tokens(eos)) >= 6
    stop_id = run(
        engine,
        Request(
            "t",
            prompt(3),
            SamplingParams(max_tokens=12, min_tokens=5, ignore_eos=True, stop_token_ids=(free[0],)),
        ),
    )["t"]
    assert free[0] not in tokens(stop_id)[:5] and len(tokens(stop_id)) >= 5
    stop = text[:3]  # would end the request at once
    cut = run(engine, Request("c", prompt(3), SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,))))[
        "c"
    ]
    held = run(
        engine,
        Request("h", prompt(3), SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,), min_tokens=8)),
    )["h"]
    assert len(tokens(cut)) < 8 <= len(tokens(held))
    assert tokens(held)[:8] == free[:8]  # min_tokens with no stop id among them changes no logits


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(stop_token_ids=(5, 10**6)), "stop_token_ids"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        (SamplingParams(logit_bias=((10**6, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((-3, 1.0),)), "logit_bias"),
    ],
    ids=["stop-id-too-big", "stop-id-negative", "bias-id-too-big", "bias-id-negative"],
)
def test_out_of_vocabulary_ids_are_refused(engine: LLMEngine, params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request(Request("bad", prompt(1), params))
    assert not engine.has_work()


@pytest.fixture
def client(redis_url: str) -> Any:
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield r
    r.close()


def test_worker_streams_logprobs_and_refuses_bad_ids_with_400(zoo: ZooPaths, client: redis.Redis) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with start(zoo, client):
        enqueue(client, QueuedRequest("lp", "tiny", prompt(4), params))
        enqueue(client, QueuedRequest("bad", "tiny", prompt(4), SamplingParams(logit_bias=((10**6, 1.0),))))
        events = collect(client, "lp")
        [error] = collect(client, "bad")
    assert error.error is not None and error.error["status"] == 400 and "logit_bias" in error.error["message"]
    expected = run(LLMEngine(zoo.base("tiny"), EngineConfig()), Request("lp", prompt(4), params))["lp"]
    assert [e.token_ids for e in events] == [o.new_token_ids for o in expected]
    assert [e.logprobs for e in events] == [o.logprobs for o in expected]
    assert events[0].prompt_logprobs == expected[0].prompt_logprobs and len(events[0].prompt_logprobs) == 19
    assert all(not e.prompt_logprobs for e in events[1:])


def test_penalties_stay_right_when_requests_are_preempted_and_recomputed(
    zoo: ZooPaths, hf_reference: Callable[[str], Any]
) -> None:
    # The processors' per-request state survives a preemption (the sequence keeps its tokens).
    small = LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=12, max_num_batched_tokens=48))
    params = SamplingParams(
        max_tokens=24, ignore_eos=True, repetition_penalty=0.3, presence_penalty=-1.5, frequency_penalty=-0.7
    )
    reqs = [Request(f"p{i}", prompt(50 + i, 28), params) for i in range(6)]
    outs = run(small, *reqs)
    assert small.stats.preemptions > 0
    ref = hf_reference("tiny")
    for r in reqs:
        assert tokens(outs[r.request_id]) == hf_greedy_with(ref, list(r.prompt_token_ids), None, 24, params)
