"""The decode graphs' choices that hold on any device (`worker.decode_graphs`): buckets, when graphs are used,
the KV pool's spare block, and an engine that comes up eagerly when a capture it was not asked for fails.
Their static path itself runs in tests/worker/test_engine_triton_interpreter.py (the Triton kernels under
the interpreter); a capture needs a GPU (scripts/gpu_checks.sh graphs)."""

from __future__ import annotations

import pytest
import torch

import worker.engine as engine_module
from kernels.backend import BACKEND_ENV
from loragate.types import Request, SamplingParams
from worker.config import EngineConfig
from worker.decode_graphs import DecodeGraphs, decode_buckets, use_graphs
from worker.engine import LLMEngine
from worker.kv_cache import KVCache
from worker.models import load_model_config
from worker.modelzoo.make import ZooPaths


def test_buckets_cover_every_batch_size_up_to_the_largest() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    buckets = decode_buckets(128)
    assert buckets[:4] == (1, 2, 4, 8) and buckets[-1] == 128 and len(buckets) == 19
    for n in range(1, 129):  # the bucket a batch of n runs in wastes fewer than 8 rows (n > 4)
        bucket = next(b for b in buckets if b >= n)
        assert bucket - n < (8 if n > 4 else n)


def test_graphs_are_used_by_default_only_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(1)
    assert use_graphs(None, cpu) is False
    assert use_graphs(False, cpu) is False
    monkeypatch.setenv(BACKEND_ENV, "torch")
    with pytest.raises(ValueError, match="Triton kernels"):
        use_graphs(True, cpu)


def test_the_spare_block_is_outside_the_blocks_sequences_get(zoo: ZooPaths) -> None:
    cfg = load_model_config(zoo.base("tiny"))
    kv = KVCache(cfg, 10, 16, torch.float32, "cpu", spare_blocks=1)
    assert kv.num_blocks == 10 and kv.k.shape[1] == 11 and kv.v.shape[1] == 11
    assert kv.pad_slot == 160
    with pytest.raises(ValueError, match="no spare block"):
        _ = KVCache(cfg, 10, 16, torch.float32, "cpu").pad_slot


def _fail(self: DecodeGraphs) -> None:
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_the_engine_eager_unless_graphs_were_asked_for(
    zoo: ZooPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "use_graphs", lambda setting, probe: True)  # as on a GPU
    monkeypatch.setattr(DecodeGraphs, "capture_all", _fail)
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=8)
    engine = LLMEngine(zoo.base("tiny"), config)
    assert engine.graphs is None and engine.kv.spare_blocks == 1
    request = Request("r", (5, 6, 7, 8), SamplingParams(max_tokens=3, ignore_eos=True))
    (done,) = engine.generate([request])
    assert len(done.token_ids) == 3 and engine.stats.graph_steps == 0
    with pytest.raises(RuntimeError, match="capturing"):
        LLMEngine(zoo.base("tiny"), EngineConfig(num_kv_blocks=64, max_num_seqs=8, cuda_graphs=True))
