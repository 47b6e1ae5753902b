"""The decoder layers in one native call a step (`kernels.decoder_native`: every linear on AMX in bf16, or
on oneDNN's packed matmul in fp32) against the same layers one kernel call at a time
(`ModelRunner._layers`): the same hidden states bit for bit, every step of a run that mixes prefill chunks,
decode rows, prefix-cache hits, adapters on every projection group and none, biases and a sliding window."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.decoder_native import decoder_run
from kernels.linear import is_packed
from kernels.sgmv_native import amx_ready
from loragate.types import Request, SamplingParams
from tests.worker.test_engine_parity import QWEN2_WINDOW, windowed_copy
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.modelzoo.make import ZooPaths


def checkpoint(zoo: ZooPaths, family: str, tmp: Path) -> tuple[Path, dict[str, Path]]:
    base = "tiny" if family == "llama" else "tiny-qwen2"
    adapters = {n: zoo.adapter(base, n) for n in zoo.adapter_names(base)}
    if family == "llama":
        return zoo.base(base), adapters
    # Qwen2: biases on q/k/v, gate/up not packed gated (344 columns of each), layer 0 full attention,
    # layer 1 windowed (shorter than the prompts).
    windowed = windowed_copy(
        zoo.base(base), tmp / "qwen2-window", use_sliding_window=True, sliding_window=QWEN2_WINDOW,
        max_window_layers=1, layer_types=None,
    )  # fmt: skip
    return windowed, adapters


def workload(vocab: int, adapters: list[str]) -> list[Request]:
    """Base and adapted requests; the second half repeat the first half's prompts (prefix-cache hits)."""
    rng = random.Random(11)
    names: list[str | None] = [None, *adapters]
    prompts = [[rng.randrange(8, vocab) for _ in range(rng.randrange(5, 70))] for _ in range(6)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    return [
        Request(f"r{i}", tuple(prompts[i % 6] + [8 + i]), params, names[i % len(names)]) for i in range(12)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2-window"])
def test_one_native_call_a_step_gives_the_python_layers_bits(
    zoo: ZooPaths, family: str, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if dtype == torch.bfloat16 and not amx_ready():
        pytest.skip("no AMX tiles on this CPU (or not granted): bf16 keeps the Python layers")
    model, adapters = checkpoint(zoo, family, tmp_path)
    # A 48-token budget: prompts in chunks, decode rows beside them, a step's adapters of every group.
    config = EngineConfig(adapters=adapters, dtype=dtype, max_num_batched_tokens=48)
    engine = LLMEngine(model, config)
    runner = engine.runner
    if dtype == torch.float32 and not is_packed(runner.w.layers[0].qkv):
        pytest.skip("oneDNN does not pack fp32 weights here: fp32 keeps the Python layers")
    plan = runner.native_layers
    assert plan is not None
    layers_in_python = runner._layers
    compared: list[tuple[int, int]] = []

    def both(h: torch.Tensor, fb: Any, groups: dict[str, Any]) -> torch.Tensor | None:
        """Each step's layers both ways on copies of the residual stream (both write the same K/V)."""
        h_native = h.clone()
        loras = [groups.get(name) for name in runner.lora_slices]
        decode = fb.decode if fb.num_decode else None
        prefill = fb.prefill if fb.num_prefill_seqs else None
        down_native = decoder_run(
            plan, h_native, fb.positions, fb.slot_mapping, fb.num_decode, decode, prefill, loras
        )
        down = layers_in_python(h, fb, groups)
        assert down is not None and torch.equal(down_native, down) and torch.equal(h_native, h)
        compared.append((fb.num_decode, fb.num_tokens - fb.num_decode))
        return down

    runner.native_layers = None  # `hidden` takes the Python path, which runs both
    monkeypatch.setattr(runner, "_layers", both)
    requests = workload(engine.info.vocab_size, list(adapters))
    tokens = [c.token_ids for c in engine.generate(requests)]
    assert any(d and p for d, p in compared)  # steps of decode rows beside prefill chunks
    assert any(p == 0 for _, p in compared)  # and of decode rows only
    # And the engine serving on the native layers gives the same tokens.
    native = LLMEngine(model, config)
    assert native.runner.native_layers is not None
    monkeypatch.setattr(native.runner, "_layers", lambda *args: pytest.fail("the Python layers ran"))
    assert [c.token_ids for c in native.generate(requests)] == tokens


def test_fp16_models_keep_the_python_layers(zoo: ZooPaths) -> None:
    """Linears neither on AMX nor packed for oneDNN (fp16 stays plain) run one kernel call at a time."""
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(dtype=torch.float16))
    assert engine.runner.native_layers is None
    assert engine.generate([Request("a", (9, 10, 11), SamplingParams(max_tokens=2, ignore_eos=True))])


def test_a_run_refuses_anything_but_a_plan(zoo: ZooPaths) -> None:
    engine = LLMEngine(zoo.base("tiny"), EngineConfig(dtype=torch.float32))
    if engine.runner.native_layers is None:
        pytest.skip("no native layers here")
    h = torch.zeros(1, engine.runner.cfg.hidden_size)
    ints = torch.zeros(1, dtype=torch.int64)
    fake = torch.zeros_like(engine.runner.native_layers)
    with pytest.raises(RuntimeError, match="not a plan made by decoder_plan"):
        none = [None] * 6
        torch.ops.loragate_cpu.decoder_run(h, fake, ints, ints, 1, *none, [None] * 4)
    with pytest.raises(RuntimeError, match="one window per layer"):
        torch.ops.loragate_cpu.decoder_plan([None] * 5, [0], ints, ints, 1, 1, 1, 1, True, True, 1e-6, 1.0)
