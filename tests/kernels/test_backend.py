"""Backend choice: torch on CPU tensors, Triton when forced (under the interpreter) or on CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import triton  # noqa: F401  # a pinned dependency: a broken install fails here, it does not skip

from kernels.backend import BACKEND_ENV, backend_choice, use_triton


def test_cpu_tensors_use_torch_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert not use_triton(torch.zeros(1))


def test_torch_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert not use_triton(torch.zeros(1))


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        use_triton(torch.zeros(1))


def test_unknown_backend_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        use_triton(torch.zeros(1))


def test_public_kernels_dispatch_to_triton_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    # Imported before TRITON_INTERPRET is set, so that on a GPU machine they stay compiled kernels.
    import kernels.attention_decode_triton
    import kernels.attention_prefill_triton
    import kernels.sgmv_triton

    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    targets = [
        (kernels.sgmv_triton, "sgmv_shrink_triton"),
        (kernels.sgmv_triton, "sgmv_expand_triton"),
        (kernels.attention_decode_triton, "paged_attention_decode_triton"),
        (kernels.attention_prefill_triton, "paged_attention_prefill_triton"),
    ]
    called: list[str] = []
    for module, name in targets:
        monkeypatch.setattr(module, name, lambda *args, name=name, **kwargs: called.append(name))
    t = torch.zeros(1, 1)
    lora = kernels.LoRABatchMeta(t, t, ())
    kernels.sgmv_shrink(t, t, t, lora, layer=0, scale=t)
    kernels.sgmv_expand(t, t, t, lora, layer=0)
    kernels.paged_attention_decode(t, t, t, t, kernels.AttentionMeta(t, t), scale=1.0)
    kernels.paged_attention_prefill(t, t, t, t, kernels.AttentionMeta(t, t, query_start_loc=t), scale=1.0)
    assert called == [name for _, name in targets]


def test_cpu_kernels_run_without_triton_installed() -> None:
    code = """
import sys
sys.modules["triton"] = None  # what an environment without triton looks like to `import`
import torch
import kernels
from kernels.backend import triton_available
meta = kernels.LoRABatchMeta.from_token_slots([0, 0, -1])
y = torch.zeros(3, 4)
x, a = torch.ones(3, 5), torch.ones(1, 1, 4, 5)
kernels.sgmv_shrink(y, x, a, meta, layer=0, scale=torch.ones(1))
print(triton_available(), y.sum().item(), sorted(m for m in sys.modules if m.endswith("_triton")))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.split() == ["False", "40.0", "[]"]


def test_backend_choice_follows_the_environment_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice is read from the environment on every call (kernels read it through `backend_choice`)."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_choice() == "auto"
    for value in ("torch", "native", "triton", "auto"):
        monkeypatch.setenv(BACKEND_ENV, value)
        assert backend_choice() == value
    monkeypatch.delenv(BACKEND_ENV)
    assert backend_choice() == "auto"
