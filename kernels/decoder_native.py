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

import torch

from kernels.attention_meta import AttentionMeta
from kernels.linear import is_packed
from kernels.linear_amx import AMXWeight
from kernels.lora_meta import LoRAGroup

# One layer's tensors in the plan's order (`Slot` in `kernels/csrc/decoder_cpu.cpp`), by the names a layer's
# weights carry (`worker.loader.LayerWeights`): the packed linears (`kernels.linear.pack_linear_weight`),
# their biases or None and the norms' weights; `layer_tensors` adds the layer's KV caches `[NB, BS, KVH, D]`.
ATTENTION_WEIGHTS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias")
WEIGHTS = (*ATTENTION_WEIGHTS, "post_norm", "gate_up", "gate_up_bias", "down", "down_bias")
QKV, O_PROJ, GATE_UP, DOWN, K_CACHE, V_CACHE = 1, 3, 6, 8, 10, 11
Layer = tuple[torch.Tensor | AMXWeight | None, ...]


def layer_tensors(weights: object, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Layer:
    """A layer as the plan takes it: `weights`' tensors named in `WEIGHTS`, then its caches."""
    return (*(getattr(weights, name) for name in WEIGHTS), k_cache, v_cache)


def runs_natively(layers: Sequence[Layer], dtype: torch.dtype) -> bool:
    """Whether `decoder_plan` takes these layers of a `dtype` model: every linear on the AMX kernel (q/k/v,
    o and down in their own column order; gate/up gated in every layer or in none), or every one packed
    for oneDNN in `dtype` itself (not widened), contiguous CPU caches, and the native ops built."""
    from kernels import native

    def on_amx(layer: Layer) -> bool:
        own_order = all(
            isinstance(w, AMXWeight) and not w.gated for w in (layer[QKV], layer[O_PROJ], layer[DOWN])
        )
        return own_order and isinstance(layer[GATE_UP], AMXWeight)

    def on_onednn(layer: Layer) -> bool:
        linears = (layer[QKV], layer[O_PROJ], layer[GATE_UP], layer[DOWN])
        return all(isinstance(w, torch.Tensor) and is_packed(w) and w.dtype == dtype for w in linears)

    def cache_fits(c: object) -> bool:
        return isinstance(c, torch.Tensor) and c.is_cpu and c.is_contiguous()

    return (
        bool(layers)
        and (all(on_amx(layer) for layer in layers) or all(on_onednn(layer) for layer in layers))
        and len({getattr(layer[GATE_UP], "gated", False) for layer in layers}) == 1
        and all(cache_fits(layer[K_CACHE]) and cache_fits(layer[V_CACHE]) for layer in layers)
        and native.available()
        and hasattr(torch.ops.loragate_cpu, "decoder_run")
    )


def decoder_plan(
    layers: Sequence[Layer],
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
        layers: every decoder layer (`layer_tensors`), in order (`runs_natively` must hold).
        windows: per layer, the keys a query sees (its own included), or None for all.
        cos, sin: the RoPE tables `[max_positions, head_dim]` in the model's dtype.
        heads, kv_heads, head_dim: the attention's shape.
        eps: the RMSNorms' epsilon.
        scale: the attention's softmax scale.
    """
    tensors = [t.panels if isinstance(t, AMXWeight) else t for layer in layers for t in layer]
    gate_up = layers[0][GATE_UP]
    amx = isinstance(gate_up, AMXWeight)
    gated = amx and gate_up.gated  # type: ignore[union-attr]
    inter = (gate_up.out_features if isinstance(gate_up, AMXWeight) else gate_up.shape[0]) // 2  # type: ignore[union-attr]
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
    dec_tables = dec_lens = pre_tables = pre_starts = pre_lens = pre_prompt = None
    if decode is not None:
        dec_tables, dec_lens = decode.block_tables.contiguous(), decode.context_lens.contiguous()
    if prefill is not None:
        assert prefill.query_start_loc is not None, "a prefill group has query starts"
        pre_tables, pre_lens = prefill.block_tables.contiguous(), prefill.context_lens.contiguous()
        pre_starts = prefill.query_start_loc.contiguous()
        # without prompt lengths no row is a prompt row: all on the vector kernel
        given = prefill.prompt_lens
        pre_prompt = torch.zeros_like(pre_lens) if given is None else given.contiguous()
    plans = [None if group is None else group.native_plan for group in loras]
    return torch.ops.loragate_cpu.decoder_run(
        h, plan, positions.contiguous(), slot_mapping.contiguous(), num_decode,
        dec_tables, dec_lens, pre_tables, pre_starts, pre_lens, pre_prompt, plans,
    )  # fmt: skip
