"""A Llama-family model's decoder layers in one native call per step (`kernels/csrc/decoder_cpu.cpp`), where
every linear layer runs on the AMX kernel (`kernels.linear_amx`, bf16) or every one on oneDNN's packed
matmul (`kernels.linear`, fp32).

The call runs the kernels a Python forward calls one by one (`add_rms_norm`, `linear`, `sgmv_group`,
`rope_write_kv`, `paged_attention_decode` / `_prefill`, `linear_amx_silu_mul` or `silu_mul`), in the same
order on the same inputs: the same bits, without a trip through the interpreter between them (on SmolLM2,
2.4 ms of a 15 ms one-row step and 3.9 ms of a 34 ms 64-row one were those trips; docs/BENCHMARKS.md).
`decoder_plan` takes the model's tensors once; `decoder_run` runs one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention_meta import AttentionMeta
from kernels.linear import LinearWeight, is_packed
from kernels.linear_amx import AMXWeight
from kernels.lora_meta import LoRAGroup


@dataclass(frozen=True, slots=True)
class DecoderLayer:
    """One layer's tensors as the plan takes them: the packed linears (`kernels.linear.pack_linear_weight`),
    their biases or None, the two norms' weights and the layer's KV caches `[NB, BS, KVH, D]`."""

    input_norm: torch.Tensor
    qkv: LinearWeight
    qkv_bias: torch.Tensor | None
    o: LinearWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: LinearWeight
    gate_up_bias: torch.Tensor | None
    down: LinearWeight
    down_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _linears(layer: DecoderLayer) -> tuple[LinearWeight, ...]:
    return layer.qkv, layer.o, layer.gate_up, layer.down


def runs_natively(layers: Sequence[DecoderLayer], dtype: torch.dtype) -> bool:
    """Whether `decoder_plan` takes these layers of a `dtype` model: every linear on the AMX kernel (q/k/v,
    o and down in their own column order; gate/up gated in every layer or in none), or every one packed
    for oneDNN in `dtype` itself (not widened), contiguous CPU caches, and the native ops built."""
    from kernels import native

    def on_amx(layer: DecoderLayer) -> bool:
        plain = (layer.qkv, layer.o, layer.down)
        own_order = all(isinstance(w, AMXWeight) and not w.gated for w in plain)
        return own_order and isinstance(layer.gate_up, AMXWeight)

    def on_onednn(layer: DecoderLayer) -> bool:
        return all(is_packed(w) and w.dtype == dtype for w in _linears(layer))

    return (
        bool(layers)
        and (all(on_amx(layer) for layer in layers) or all(on_onednn(layer) for layer in layers))
        and len({getattr(layer.gate_up, "gated", False) for layer in layers}) == 1
        and all(c.is_cpu and c.is_contiguous() for layer in layers for c in (layer.k_cache, layer.v_cache))
        and native.available()
        and hasattr(torch.ops.loragate_cpu, "decoder_run")
    )


def decoder_plan(
    layers: Sequence[DecoderLayer],
    windows: Sequence[int | None],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """The model's layers laid out once for `decoder_run` (a byte tensor that holds its tensors).

    Args:
        layers: every decoder layer, in order (`runs_natively` must hold).
        windows: per layer, the keys a query sees (its own included), or None for all.
        cos, sin: the RoPE tables `[max_positions, head_dim]` in the model's dtype.
        heads, kv_heads, head_dim: the attention's shape.
        eps: the RMSNorms' epsilon.
        scale: the attention's softmax scale.
    """

    def weight(w: LinearWeight) -> torch.Tensor:
        return w.panels if isinstance(w, AMXWeight) else w

    tensors: list[torch.Tensor | None] = []
    for layer in layers:
        tensors += [layer.input_norm, weight(layer.qkv), layer.qkv_bias, weight(layer.o), layer.o_bias]
        tensors += [layer.post_norm, weight(layer.gate_up), layer.gate_up_bias, weight(layer.down)]
        tensors += [layer.down_bias, layer.k_cache, layer.v_cache]
    gate_up = layers[0].gate_up
    amx, gated = isinstance(gate_up, AMXWeight), getattr(gate_up, "gated", False)
    inter = (gate_up.out_features if isinstance(gate_up, AMXWeight) else gate_up.shape[0]) // 2
    return torch.ops.loragate_cpu.decoder_plan(
        tensors, [w or 0 for w in windows], cos, sin, heads, kv_heads, head_dim, inter, amx, gated, eps, scale
    )


def decoder_run(
    plan: torch.Tensor,
    h: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decode: int,
    decode: AttentionMeta | None,
    prefill: AttentionMeta | None,
    loras: Sequence[LoRAGroup | None],
) -> torch.Tensor:
    """Every layer on one step's residual stream; returns the last layer's MLP output (not yet added).

    Semantics:
        for each layer: h, x = add_rms_norm(h, down, input_norm); qkv = x Wqkvᵀ + b (+ its adapters);
        RoPE, KV write; attention (rows < num_decode over `decode`, the rest over `prefill`); o = ... (+
        adapters); h, x = add_rms_norm(h, o, post_norm); act = silu(gate) * up (+ adapters before the
        SiLU, which runs in the gate/up matmul where its weight is gated and no adapter changes it);
        down = act Wdownᵀ + b (+ adapters) — exactly `worker.model.ModelRunner`'s Python layers.

    Args:
        plan: from `decoder_plan`.
        h: Shape `[T, hidden]`, contiguous. The residual stream, updated in place.
        positions, slot_mapping: Shape `[T]`, int64. Each token's position and KV slot.
        num_decode: the first rows that are decode rows (one per sequence).
        decode: the decode rows' attention metadata (None when there are none).
        prefill: the prefill rows' attention metadata (None when there are none).
        loras: the step's LoRA group of qkv, o, gate_up and down, in that order, each None where no adapter
            of the step touches it.
    Returns:
        Shape `[T, hidden]`. The last layer's MLP output.
    """
    dec_tables = dec_lens = pre_tables = pre_rows = pre_lens = None
    if decode is not None:
        dec_tables, dec_lens = decode.block_tables.contiguous(), decode.context_lens.contiguous()
    if prefill is not None:
        pre_tables = prefill.block_tables.contiguous()
        pre_rows, pre_lens = prefill.per_query
    plans = [None if group is None else group.native_plan for group in loras]
    return torch.ops.loragate_cpu.decoder_run(
        h, plan, positions.contiguous(), slot_mapping.contiguous(), num_decode,
        dec_tables, dec_lens, pre_tables, pre_rows, pre_lens, plans,
    )  # fmt: skip
