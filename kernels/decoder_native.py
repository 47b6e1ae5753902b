"""A Llama-family model's decoder layers in one native call per step (`kernels/csrc/decoder_cpu.cpp`), where
every linear layer runs on the AMX kernel (`kernels.linear_amx`).

The call runs the kernels a Python forward calls one by one (`add_rms_norm`, `linear_amx`, `sgmv_group`,
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
from kernels.linear_amx import AMXWeight
from kernels.lora_meta import LoRAGroup


@dataclass(frozen=True, slots=True)
class DecoderLayer:
    """One layer's tensors as the plan takes them: AMX-packed linears (gate/up gated or not), their biases
    or None, the two norms' weights and the layer's KV caches `[NB, BS, KVH, D]` (contiguous)."""

    input_norm: torch.Tensor
    qkv: AMXWeight
    qkv_bias: torch.Tensor | None
    o: AMXWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: AMXWeight
    gate_up_bias: torch.Tensor | None
    down: AMXWeight
    down_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def runs_natively(layers: Sequence[DecoderLayer]) -> bool:
    """Whether `decoder_plan` takes these layers: every linear on the AMX kernel (q/k/v, o and down in their
    own column order; gate/up gated in every layer or in none), contiguous CPU caches, and the native ops
    built."""
    from kernels import native

    def linears_fit(layer: DecoderLayer) -> bool:
        plain = (layer.qkv, layer.o, layer.down)
        own_order = all(isinstance(w, AMXWeight) and not w.gated for w in plain)
        return own_order and isinstance(layer.gate_up, AMXWeight)

    return (
        bool(layers)
        and all(linears_fit(layer) for layer in layers)
        and len({layer.gate_up.gated for layer in layers}) == 1
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
    tensors: list[torch.Tensor | None] = []
    for layer in layers:
        tensors += [layer.input_norm, layer.qkv.panels, layer.qkv_bias, layer.o.panels, layer.o_bias]
        tensors += [layer.post_norm, layer.gate_up.panels, layer.gate_up_bias, layer.down.panels]
        tensors += [layer.down_bias, layer.k_cache, layer.v_cache]
    inter, gated = layers[0].gate_up.out_features // 2, layers[0].gate_up.gated
    return torch.ops.loragate_cpu.decoder_plan(
        tensors, [w or 0 for w in windows], cos, sin, heads, kv_heads, head_dim, inter, gated, eps, scale
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
