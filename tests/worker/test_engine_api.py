"""The engine's step API: validation up front, streaming deltas, stops, abort, sampling, max_loras."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from loragate.contracts import AdapterTier, EventType, KVEvent
from loragate.hashing import block_hashes
from loragate.types import FinishReason, Request, RequestOutput, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.lora import AdapterError
from worker.modelzoo.make import ZooPaths


@pytest.fixture(scope="module")
def engine(zoo: ZooPaths) -> LLMEngine:
    adapters = {n: zoo.adapter("tiny", n) for n in zoo.adapter_names("tiny")}
    return LLMEngine(zoo.base("tiny"), EngineConfig(adapters=adapters, num_kv_blocks=256))


def prompt(seed: int, n: int = 20) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(8, 8000) for _ in range(n))


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: LLMEngine, *requests: Request) -> dict[str, list[RequestOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request("e1", (), greedy()), "empty"),
        (Request("e2", (1, 2, 99999), greedy()), "token ids"),
        (Request("e3", prompt(1, 2040), greedy(16)), "context length"),
        (Request("e4", prompt(1), greedy(), adapter="no-such-adapter"), "unknown adapter"),
    ],
)
def test_bad_requests_fail_in_add_request(engine: LLMEngine, request_: Request, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_)
    assert not engine.has_work()


def test_duplicate_request_id_is_rejected(engine: LLMEngine) -> None:
    engine.add_request(Request("dup", prompt(2), greedy(2)))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(Request("dup", prompt(3), greedy(2)))
    run(engine)


def test_bad_sampling_params_are_rejected() -> None:
    for kw in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)  # type: ignore[arg-type]


def test_streamed_deltas_add_up_to_the_decoded_text(engine: LLMEngine) -> None:
    outs = run(engine, Request("s", prompt(4), greedy(24)))["s"]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 24 and all(len(o.new_token_ids) == 1 for o in outs)
    assert "".join(o.text_delta for o in outs) == engine.tokenizer.decode(tokens)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert [o.completion_tokens for o in outs] == list(range(1, 25))
    assert not any(o.finished for o in outs[:-1])


def test_stop_string_cuts_text_and_is_never_streamed(engine: LLMEngine) -> None:
    full = run(engine, Request("full", prompt(5), greedy(30)))["full"]
    text = "".join(o.text_delta for o in full)
    stop = text[10:14]
    assert stop and text.find(stop) == 10
    outs = run(engine, Request("cut", prompt(5), greedy(30, stop=(stop, "\x00never"))))["cut"]
    streamed = "".join(o.text_delta for o in outs)
    assert streamed == text[:10]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert len(outs) < 30


def test_stop_token_id_ends_the_request_without_its_text(engine: LLMEngine) -> None:
    full = run(engine, Request("f2", prompt(6), greedy(20)))["f2"]
    tokens = [o.new_token_ids[0] for o in full]
    stop_at = next(i for i in range(3, 20) if tokens[i] not in tokens[:i])
    outs = run(engine, Request("t2", prompt(6), greedy(20, stop_token_ids=(tokens[stop_at],))))["t2"]
    assert [o.new_token_ids[0] for o in outs] == tokens[: stop_at + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text_delta for o in outs) == engine.tokenizer.decode(tokens[:stop_at])


def test_eos_stops_unless_ignored(engine: LLMEngine) -> None:
    full = run(engine, Request("f3", prompt(7), greedy(12)))["f3"]
    tokens = [o.new_token_ids[0] for o in full]
    eos = tokens[4] if tokens[4] not in tokens[:4] else tokens[0]
    original = engine.model_config
    engine.model_config = dataclasses.replace(original, eos_token_ids=(eos,))
    try:
        stopped = run(engine, Request("e", prompt(7), SamplingParams(max_tokens=12)))["e"]
        ignored = run(engine, Request("i", prompt(7), SamplingParams(max_tokens=12, ignore_eos=True)))["i"]
    finally:
        engine.model_config = original
    assert stopped[-1].new_token_ids == (eos,) and stopped[-1].finish_reason is FinishReason.STOP
    assert len(stopped) == tokens.index(eos) + 1
    assert len(ignored) == 12


def test_abort_frees_the_sequence_and_reports_it(engine: LLMEngine) -> None:
    free = engine.blocks.num_free_blocks
    engine.add_request(Request("a", prompt(8, 40), greedy(50)))
    engine.add_request(Request("b", prompt(9, 40), greedy(3)))
    engine.step()
    engine.step()
    assert engine.blocks.num_free_blocks < free
    assert engine.abort("a") and not engine.abort("a")
    outs = run(engine)
    assert [o.finish_reason for o in outs["a"]] == [FinishReason.ABORT]
    assert outs["b"][-1].finish_reason is FinishReason.LENGTH
    assert engine.blocks.num_free_blocks == free


def test_abort_output_arrives_on_next_step(engine: LLMEngine) -> None:
    engine.add_request(Request("x", prompt(11), greedy(50)))
    engine.step()
    engine.abort("x")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("x", True, FinishReason.ABORT)]
    assert not engine.has_work()


def test_seeded_sampling_is_independent_of_batch_mates(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run(engine, Request("alone", prompt(12), params))["alone"]
    mates = [
        Request(f"m{i}", prompt(100 + i, 10 + 7 * i), greedy(20), "attn-r16" if i % 2 else None)
        for i in range(5)
    ]
    crowd = run(engine, *mates, Request("crowd", prompt(12), params))["crowd"]
    assert [o.new_token_ids for o in alone] == [o.new_token_ids for o in crowd]
    other = run(engine, Request("other", prompt(12), dataclasses.replace(params, seed=4321)))["other"]
    assert [o.new_token_ids for o in other] != [o.new_token_ids for o in alone]


def test_top_k_1_and_tiny_top_p_are_greedy(engine: LLMEngine) -> None:
    g = run(engine, Request("g", prompt(13), greedy(10)))["g"]
    k1 = run(engine, Request("k1", prompt(13), greedy(10, temperature=1.5, top_k=1)))["k1"]
    p0 = run(engine, Request("p0", prompt(13), greedy(10, temperature=1.5, top_p=1e-6)))["p0"]
    ids = [o.new_token_ids for o in g]
    assert [o.new_token_ids for o in k1] == ids and [o.new_token_ids for o in p0] == ids


def test_max_loras_bounds_adapters_per_step(zoo: ZooPaths, hf_reference: Callable[[str], Any]) -> None:
    names = zoo.adapter_names("tiny")[:4]
    engine = LLMEngine(
        zoo.base("tiny"), EngineConfig(adapters={n: zoo.adapter("tiny", n) for n in names}, max_loras=2)
    )
    requests = [Request(f"l{i}", prompt(200 + i, 15), greedy(8), names[i % 4]) for i in range(8)]
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
        assert len({s.adapter for s in engine.scheduler.running}) <= 2
    assert engine.adapters.device_loads > 2  # slots were recycled between adapters
    ref = hf_reference("tiny")
    for r in requests:
        assert tokens[r.request_id] == ref.greedy(list(r.prompt_token_ids), 8, r.adapter)


def test_adapter_for_another_base_fails_with_a_clear_error(zoo: ZooPaths, engine: LLMEngine) -> None:
    name = zoo.adapter_names("small")[0]
    engine.register_adapter("wrong-base", zoo.adapter("small", name))
    with pytest.raises(AdapterError, match="made for another base model"):
        engine.add_request(Request("wb", prompt(14), greedy(), adapter="wrong-base"))
    assert not engine.has_work()


def test_resuming_another_workers_request_continues_tokens_and_text_exactly(engine: LLMEngine) -> None:
    """A worker that takes over after a crash gets the tokens and text already streamed; the rest of the
    answer must be exactly what the first worker would have produced, even when the crash fell inside a
    multi-byte character that was still held back."""
    n = 24
    split_inside_char = False
    for seed in range(40, 60):
        full = run(engine, Request(f"full{seed}", prompt(seed, 12), greedy(n)))[f"full{seed}"]
        tokens = [o.new_token_ids[0] for o in full]
        texts = [o.text_delta for o in full]
        for k in range(1, n):
            streamed = "".join(texts[:k])
            split_inside_char |= streamed != engine.tokenizer.decode(tokens[:k])
            resumed = run(
                engine,
                Request(
                    f"r{seed}-{k}",
                    prompt(seed, 12),
                    greedy(n),
                    resume_token_ids=tuple(tokens[:k]),
                    resume_text=streamed,
                ),
            )
            outs = resumed[f"r{seed}-{k}"]
            assert [o.new_token_ids[0] for o in outs] == tokens[k:]
            assert streamed + "".join(o.text_delta for o in outs) == "".join(texts), (seed, k)
            assert outs[-1].completion_tokens == n and outs[-1].finish_reason is FinishReason.LENGTH
        if split_inside_char:
            break
    assert split_inside_char  # the hard case was exercised


# -- snapshot() and drain_events(): what the worker service publishes -------------------------------------


@pytest.fixture
def small_pool(zoo: ZooPaths) -> tuple[LLMEngine, str, str]:
    """A fresh engine with one adapter slot and 6 KV blocks of 16 tokens, so slots and blocks recycle;
    and the names of its two adapters."""
    first, second = zoo.adapter_names("tiny")[:2]
    adapters = {n: zoo.adapter("tiny", n) for n in (first, second)}
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(adapters=adapters, num_kv_blocks=6, max_loras=1))
    return engine, first, second


def adapter_moves(events: list[KVEvent]) -> list[tuple[EventType, str | None, AdapterTier | None]]:
    return [(e.type, e.adapter, e.tier) for e in events if e.adapter is not None]


def block_events(events: list[KVEvent], kind: EventType) -> list[int]:
    return [h for e in events if e.type is kind for h in e.hashes]


def test_snapshot_counts_requests_blocks_adapters_and_tokens(small_pool: tuple[LLMEngine, str, str]) -> None:
    engine, name, _ = small_pool
    start = engine.snapshot()
    assert (start.running, start.waiting, start.kv_blocks_free, start.kv_blocks_total) == (0, 0, 6, 6)
    assert (start.steps, start.generated_tokens, start.cached_blocks, start.adapters_device) == (0, 0, 0, ())
    engine.add_request(Request("s1", prompt(30, 40), greedy(8), adapter=name))
    engine.add_request(Request("s2", prompt(31, 10), greedy(8)))
    queued = engine.snapshot()
    assert (queued.running, queued.waiting, engine.num_waiting) == (0, 2, 2)
    assert queued.adapters_host == (name,) and queued.adapter_disk_reads == 1  # read in add_request
    engine.step()
    busy = engine.snapshot()
    assert (busy.running, busy.waiting, busy.steps) == (2, 0, 1)
    assert busy.kv_blocks_free == 6 - 3 - 1  # 40 + 10 prompt tokens in 16-token blocks
    assert busy.adapters_device == (name,) and busy.adapter_device_loads == 1
    assert (busy.prefix_queried_tokens, busy.prefix_hit_tokens) == (50, 0)
    assert busy.cached_blocks == 2  # the two full blocks of s1's prompt, published once computed
    while engine.has_work():
        engine.step()
    done = engine.snapshot()
    assert (done.running, done.waiting, done.kv_blocks_free, done.generated_tokens) == (0, 0, 6, 16)
    assert done.steps == 8 and done.preemptions == 0


def test_drain_events_reports_stored_evicted_blocks_and_adapter_moves(
    small_pool: tuple[LLMEngine, str, str],
) -> None:
    engine, first, second = small_pool
    p1 = prompt(40, 40)
    run(engine, Request("d1", p1, greedy(8), adapter=first))
    events = engine.drain_events()
    stored = block_events(events, EventType.STORED)
    assert stored == block_hashes(p1, 16, first)  # 47 tokens computed: two full blocks, both prompt
    assert adapter_moves(events) == [
        (EventType.ADAPTER_LOADED, first, AdapterTier.HOST),
        (EventType.ADAPTER_LOADED, first, AdapterTier.DEVICE),
    ]
    assert engine.drain_events() == []  # drained: nothing new
    # 88 tokens need all six blocks: the cached ones are evicted; one slot: the first adapter goes back
    # to host memory.
    run(engine, Request("d2", prompt(41, 80), greedy(8), adapter=second))
    events = engine.drain_events()
    assert sorted(block_events(events, EventType.EVICTED)) == sorted(stored)
    assert block_events(events, EventType.STORED) == block_hashes(prompt(41, 80), 16, second)
    assert adapter_moves(events) == [
        (EventType.ADAPTER_LOADED, second, AdapterTier.HOST),
        (EventType.ADAPTER_EVICTED, first, AdapterTier.HOST),
        (EventType.ADAPTER_LOADED, second, AdapterTier.DEVICE),
    ]


def test_state_events_describe_everything_held_and_drop_pending_changes(
    small_pool: tuple[LLMEngine, str, str],
) -> None:
    engine, first, second = small_pool
    run(engine, Request("f1", prompt(50, 20), greedy(4), adapter=first))
    run(engine, Request("f2", prompt(51, 36), greedy(4), adapter=second))
    state = engine.state_events()
    assert state[0].type is EventType.CLEARED
    assert sorted(block_events(state, EventType.STORED)) == sorted(
        block_hashes(prompt(50, 20), 16, first) + block_hashes(prompt(51, 36), 16, second)
    )
    assert adapter_moves(state) == [
        (EventType.ADAPTER_LOADED, first, AdapterTier.HOST),
        (EventType.ADAPTER_LOADED, second, AdapterTier.DEVICE),
    ]
    assert engine.drain_events() == []  # covered by the state description
    snap = engine.snapshot()
    assert snap.cached_blocks == len(block_events(state, EventType.STORED))
    assert snap.adapters_device == (second,) and set(snap.adapters_host) == {first, second}


def test_a_forward_pass_reads_nothing_back_from_the_device(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segment bounds, slot ranks and scales, context lengths and query starts are Python values made
    once per step: the model's forward (every layer, LoRA on, prefill and decode mixed) calls no
    `.tolist()`, the read-back that costs a device sync per call on a GPU."""
    names = list(engine.adapters.paths)[:2]
    first = Request("rb-1", prompt(41), greedy(4), names[0])
    engine.add_request(first)
    engine.step()  # rb-1 decodes next step, beside rb-2's prefill
    engine.add_request(Request("rb-2", prompt(42, 30), greedy(4), names[1]))
    scheduled = engine.scheduler.schedule().scheduled
    assert sorted(n for _, n in scheduled) == [1, 30]
    batch, _, _ = engine._prepare(scheduled)
    lora = engine._lora_context(batch)
    assert lora is not None and batch.lora is not None
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        reads.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    engine.runner.forward(batch, lora)
    monkeypatch.undo()
    assert reads == []
    for rid in ("rb-1", "rb-2"):
        engine.abort(rid)
    while engine.has_work():
        engine.step()
