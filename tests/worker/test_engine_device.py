"""The engine follows `EngineConfig.device` and `.dtype` everywhere: state, step inputs, kernel arguments,
sampling; and it runs in bfloat16 and float16 on the CPU, close to float32.

Placement is proven on the `meta` device, which has no data: any op that mixes a meta tensor with a CPU
one fails exactly as it would with a CUDA one, so a step that runs on meta leaves nothing on the host.
The kernels themselves cannot run on meta (the torch paths read segment bounds on the host, Triton needs
memory); in that test they are replaced by stand-ins that record their tensors' devices. The
kernels are proven on their own by tests/kernels and, inside the engine, by
test_engine_triton_interpreter.py.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

import worker.model
from kernels.linear import bf16_units, is_packed
from kernels.linear_amx import AMXWeight
from kernels.lm_head import PackedLMHead
from kernels.sgmv_native import amx_ready
from loragate.messages import WorkerState
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.heartbeat import engine_state
from worker.modelzoo.make import ZooPaths

KERNELS = ("rope_write_kv", "paged_attention_decode", "paged_attention_prefill", "sgmv_group", "linear")
ADAPTERS = ("qv-r8", "all-r64", "mlp-r32")
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True)


def engine_on(zoo: ZooPaths, **config: Any) -> LLMEngine:
    adapters = {n: zoo.adapter("tiny", n) for n in ADAPTERS}
    return LLMEngine(zoo.base("tiny"), EngineConfig(adapters=adapters, num_kv_blocks=32, **config))


def requests(n: int, max_tokens: int = 8, prefix: str = "r", **params: Any) -> list[Request]:
    rng = random.Random(5)
    adapters: list[str | None] = [None, *ADAPTERS]
    return [
        Request(
            f"{prefix}{i}",
            tuple(rng.randrange(8, 8000) for _ in range(6 + 5 * i)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
            adapters[i % len(adapters)],
        )
        for i in range(n)
    ]


def state_tensors(engine: LLMEngine) -> dict[str, torch.Tensor]:
    w = engine.runner.w
    head = w.lm_head.panels if isinstance(w.lm_head, PackedLMHead | AMXWeight) else w.lm_head
    out = {"embed": w.embed, "norm": w.norm, "lm_head": head, "k": engine.kv.k, "v": engine.kv.v}
    out |= {"rope.cos": engine.runner.rope.cos, "rope.sin": engine.runner.rope.sin}
    for i, layer in enumerate(w.layers):
        for name in layer.__slots__:
            t = getattr(layer, name)
            if t is not None:
                out[f"layers.{i}.{name}"] = t.panels if isinstance(t, AMXWeight) else t
    for module, stack in engine.adapters.stacks.items():
        out |= {f"{module}.{k}": getattr(stack, k) for k in ("a", "b", "ranks", "scale")}
    return out


def weight_objects(engine: LLMEngine) -> dict[str, object]:
    """The LM head and each layer's linear weights as the runner holds them (packed or not)."""
    w = engine.runner.w
    out: dict[str, object] = {"lm_head": w.lm_head}
    for i, layer in enumerate(w.layers):
        out |= {f"layers.{i}.{name}": getattr(layer, name) for name in ("qkv", "o", "gate_up", "down")}
    return out


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a kernel argument: itself, or those of a metadata object (`AttentionMeta`,
    `LoRABatchMeta`, `LoRAGroup` and its projections) or of a sequence of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [t for v in vars(value).values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def recording(calls: list[tuple[str, set[str]]], name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        tensors = tensors_in([*args, *kwargs.values()])
        calls.append((name, {str(t.device) for t in tensors}))
        if name == "linear":  # its result is used: the shape of the real one, on the input's device
            x, w = args[0], args[1]
            return x.new_empty(x.shape[0], w.shape[0])
        return None

    return kernel


def test_a_step_on_the_meta_device_leaves_nothing_on_the_host(
    zoo: ZooPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_on(zoo, device="meta", max_num_batched_tokens=24)
    calls: list[tuple[str, set[str]]] = []
    for name in KERNELS:
        monkeypatch.setattr(worker.model, name, recording(calls, name))
    for r in requests(4):
        engine.add_request(r)  # greedy: a sampled request's generator needs a real device
    for step in range(3):  # chunked prefill (budget 24 of 50 prompt tokens), then decode mixed in
        scheduled = engine.scheduler.schedule().scheduled
        batch, order, sampled_seqs = engine._prepare(scheduled)
        lora = engine._lora_context(batch)
        assert lora is not None and lora.metas
        metas = (batch.decode, batch.prefill, batch.lora)
        batch_tensors = [v for m in (batch, *metas) for v in vars(m).values() if isinstance(v, torch.Tensor)]
        assert len(batch_tensors) == 4 + 2 + 4 + 2, step  # the batch's own, decode, prefill and LoRA
        assert {t.device.type for t in batch_tensors} == {"meta"}, step
        logits = engine.runner.forward(batch, lora)
        # Sampled rows (top-k, top-p) next to greedy ones; no generator, as meta cannot have one.
        params = [SAMPLED if i % 2 else s.request.params for i, s in enumerate(sampled_seqs)]
        tokens = engine.sampler.select(logits, params, [None] * len(sampled_seqs))
        assert logits.device.type == tokens.device.type == "meta"
        for seq, n in order:  # what `step` does with the results, a token id standing in for the sample
            seq.num_computed_tokens += n
            engine.blocks.commit(seq)
        for seq in sampled_seqs:
            seq.token_ids.append(1)
    assert {name for name, _ in calls} == set(KERNELS)
    assert all(devices == {"meta"} for _, devices in calls), calls
    placed = {name: t.device.type for name, t in state_tensors(engine).items()}
    assert set(placed.values()) == {"meta"}, [n for n, d in placed.items() if d != "meta"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16_bit_on_cpu_runs_and_stays_close_to_float32(
    zoo: ZooPaths, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="worker.model"):
        engines = {d: engine_on(zoo, dtype=d) for d in (torch.float32, dtype)}
    low = engines[dtype]
    # Adapter ranks and scales keep their own types; weights, KV cache and adapter slots follow the engine,
    # but bf16's packed linear weights on a CPU without bf16 units are widened to fp32 (`kernels.linear`).
    kept = ("ranks", "scale")
    wide = dtype == torch.bfloat16 and not bf16_units()
    dtypes = {n: t.dtype for n, t in state_tensors(low).items() if not n.endswith(kept)}
    # The LM head is packed for the native kernel (`kernels.lm_head`) wherever its linear would be widened.
    head_packed = isinstance(low.runner.w.lm_head, PackedLMHead)
    assert head_packed == wide
    # With AMX, bf16 linears and the LM head are packed for the native AMX kernel (`kernels.linear_amx`).
    amx = {n for n, t in weight_objects(low).items() if isinstance(t, AMXWeight)}
    assert bool(amx) == (dtype == torch.bfloat16 and amx_ready())
    # ... the MLP's gate/up gated, so that a step whose adapters leave it alone gets SiLU in its matmul.
    gated = {n for n, t in weight_objects(low).items() if isinstance(t, AMXWeight) and t.gated}
    assert gated == {n for n in amx if n.endswith(".gate_up")}
    tensors = state_tensors(low).items()
    packed = {n for n, t in tensors if is_packed(t) or (n == "lm_head" and head_packed)} | amx
    if dtype == torch.bfloat16:  # oneDNN packs bf16 weights on x86 (fp16 stays plain)
        assert len(packed) == 4 * len(low.runner.w.layers) + 1  # qkv, o, gate_up, down, LM head
        assert {dtypes[n] for n in packed} == {torch.float32 if wide else dtype}
    assert ("bf16 linear weights held as fp32" in caplog.text) == wide  # the memory cost is logged
    assert {d for n, d in dtypes.items() if n not in packed} == {dtype}
    # One prefill step of five mixed-adapter prompts in each dtype: next-token logits agree closely.
    logits = {}
    for d, engine in engines.items():
        for r in requests(5):
            engine.add_request(r)
        batch, _, sampled_seqs = engine._prepare(engine.scheduler.schedule().scheduled)
        lora = engine._lora_context(batch)
        assert len(sampled_seqs) == 5
        logits[d] = engine.runner.forward(batch, lora).float()
        for r in requests(5):
            engine.abort(r.request_id)
        engine.step()
    assert torch.isfinite(logits[dtype]).all()
    cosine = torch.nn.functional.cosine_similarity(logits[torch.float32], logits[dtype], dim=-1)
    assert cosine.min() > 0.99, cosine
    assert (logits[torch.float32].argmax(-1) == logits[dtype].argmax(-1)).sum() >= 4
    # And whole requests run to the end, greedy and seeded sampling alike.
    greedy = low.generate(requests(4, max_tokens=12))
    sampled = low.generate(
        requests(4, max_tokens=12, prefix="s", temperature=0.8, top_k=20, top_p=0.9, seed=3)
    )
    assert all(len(c.token_ids) == 12 for c in (*greedy, *sampled))
    state = engine_state(low, "w1", "tiny", set(), False, 0.0)
    assert (state.device, state.dtype) == ("cpu", str(dtype).removeprefix("torch."))
    assert state.max_running == low.config.max_num_seqs  # the gateway admits this many before queueing
    assert WorkerState.from_json(state.to_json()) == state


@pytest.mark.skipif(not amx_ready(), reason="no AMX tiles on this CPU (or not granted)")
def test_bf16_steps_whose_adapters_leave_the_mlp_alone_take_silu_in_its_matmul(
    zoo: ZooPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AMX the MLP's SiLU runs inside the gate/up matmul (`kernels.linear.linear_silu_mul`) in every layer
    of a step where no adapter changes gate/up (base rows, q/v adapters), and after it where one does, and
    a greedy step's tokens are picked inside the LM head's matmul; the tokens are those of the unfused path
    with the logits computed (rows asking for logprobs) either way."""
    engines = [engine_on(zoo, dtype=torch.bfloat16)]
    engines[0].runner.native_layers = None  # its layers one kernel call at a time, each seen here
    fused = worker.model.linear_silu_mul
    calls: list[int] = []

    def counting(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return fused(x, *args)

    monkeypatch.setattr(worker.model, "linear_silu_mul", counting)
    layers = len(engines[0].runner.w.layers)

    def run(adapter: str | None, tag: str, **params: Any) -> tuple[list[list[int]], int]:
        """The tokens of three requests on `adapter`, and how many layers of their steps fused SiLU."""
        engine = engines[-1]
        calls.clear()
        steps = engine.stats.steps
        batch = [
            dataclasses.replace(r, request_id=f"{tag}-{r.request_id}", adapter=adapter)
            for r in requests(3, **params)
        ]
        tokens = [c.token_ids for c in engine.generate(batch)]
        return tokens, len(calls) - layers * (engine.stats.steps - steps)

    (base, base_left), (qv, qv_left) = run(None, "base"), run("qv-r8", "qv")
    assert calls and base_left == 0 and qv_left == 0  # every layer of every step
    assert engines[0].stats.fused_greedy_steps == engines[0].stats.steps
    mlp, _ = run("mlp-r32", "mlp")
    assert not calls  # gate/up adapted: the plain matmul, its adapter, then silu_mul
    monkeypatch.setattr(worker.model, "fuses_silu", lambda weight: False)
    engines.append(engine_on(zoo, dtype=torch.bfloat16))  # no prefix cache from the fused runs
    engines[1].runner.native_layers = None
    assert [run(a, f"{a}-unfused", logprobs=0)[0] for a in (None, "qv-r8", "mlp-r32")] == [base, qv, mlp]
    assert not calls and engines[1].stats.fused_greedy_steps == 0
