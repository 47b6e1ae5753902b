"""The lean Llama-family forward on paged KV with multi-LoRA: plain torch ops plus `kernels/`.

One forward serves every family in `worker.models` (Llama, Qwen2, Mistral): what differs between them
is data (biases in the weights, a sliding window per layer in the config), not code.

Matches Hugging Face's computation order (RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP) so greedy
outputs equal `transformers` + `peft`. Only the rows whose logits are needed reach the LM head
(`ForwardBatch.logits_indices`: sampled positions, and prompt positions of requests wanting prompt
logprobs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from kernels import (
    LoRABatchMeta,
    LoRAGroup,
    LoRAProjection,
    PackedLMHead,
    add_rms_norm,
    linear,
    lm_head_argmax,
    lm_head_logits,
    pack_linear_weight,
    pack_lm_head,
    paged_attention_decode,
    paged_attention_prefill,
    rope_write_kv,
    sgmv_group,
    silu_mul,
)
from kernels.backend import use_native
from kernels.decoder_native import decoder_plan, decoder_run, layer_tensors, runs_natively
from kernels.linear import BF16_LINEAR_ENV, LinearWeight, fuses_silu, linear_silu_mul
from kernels.linear_amx import AMXWeight
from worker.adapter_cache import LoRAStack
from worker.batch import ForwardBatch
from worker.config import ModelConfig
from worker.kv_cache import KVCache
from worker.loader import LayerWeights, ModelWeights
from worker.rope import RotaryEmbedding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAContext:
    """The adapter stacks for this step and, for each target module any active slot adapts, the step's
    segment metadata with that module's slot tables on the host (`LoRABatchMeta.for_module`)."""

    stacks: dict[str, LoRAStack]
    metas: dict[str, LoRABatchMeta]


def pack_weights(weights: ModelWeights) -> ModelWeights:
    """`weights`, each matmul's weight now in the device's fastest layout (`kernels.linear`), layer by
    layer in place, so the plain tensors are freed as their packed copies are made (a tied LM head gets
    its own packed copy: the embedding table stays plain for lookups)."""
    widened = 0  # bytes of bf16 weights packed as fp32

    def pack(w: LinearWeight, gated: bool = False) -> LinearWeight:
        nonlocal widened
        packed = pack_linear_weight(w, gated)
        if packed.dtype != w.dtype:
            widened += 4 * w.shape[0] * w.shape[1]
        return packed

    head = pack_lm_head(weights.lm_head)
    if head.dtype != weights.lm_head.dtype:
        widened += head.nbytes if isinstance(head, PackedLMHead) else 4 * head.shape[0] * head.shape[1]

    for i, layer in enumerate(weights.layers):
        weights.layers[i] = replace(
            layer,
            qkv=pack(layer.qkv),
            o=pack(layer.o),
            gate_up=pack(layer.gate_up, gated=True),
            down=pack(layer.down),
        )
    weights.lm_head = head
    if widened:
        log.info(
            "bf16 linear weights held as fp32 (%.0f MiB, twice bf16's): without bf16 units oneDNN's bf16 "
            "matmul is 2-3.7x slower; %s=native keeps them in bf16",
            widened / 2**20,
            BF16_LINEAR_ENV,
        )
    return weights


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, kv: KVCache, max_positions: int):
        self.cfg, self.w, self.kv = cfg, pack_weights(weights), kv
        device = str(weights.embed.device)
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, weights.embed.dtype, device)
        self.scale = cfg.head_dim**-0.5
        q, kvs, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        # The adaptable projections by fused output (and input), and where each one's columns start.
        self.lora_slices = {
            "qkv": {"q_proj": 0, "k_proj": q, "v_proj": q + kvs},
            "o": {"o_proj": 0},
            "gate_up": {"gate_proj": 0, "up_proj": inter},
            "down": {"down_proj": 0},
        }
        self.native_layers = self._native_layers()

    def forward(self, fb: ForwardBatch, lora: LoRAContext | None) -> torch.Tensor:
        """The logits of `fb.logits_indices`' rows."""
        return self.logits(self.hidden(fb, self.lora_groups(fb, lora)))

    @torch.inference_mode()
    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden rows (`hidden`)."""
        return lm_head_logits(last, self.w.lm_head)

    @property
    def fuses_greedy(self) -> bool:
        """Whether `greedy_tokens` skips the logits (the head is packed for a native CPU kernel)."""
        return isinstance(self.w.lm_head, PackedLMHead | AMXWeight)

    @torch.inference_mode()
    def greedy_tokens(self, fb: ForwardBatch, lora: LoRAContext | None) -> torch.Tensor:
        """`argmax_rows(forward(fb, lora))` without the logits (`kernels.lm_head.lm_head_argmax`)."""
        return lm_head_argmax(self.hidden(fb, self.lora_groups(fb, lora)), self.w.lm_head)

    @torch.inference_mode()
    def hidden(self, fb: ForwardBatch, groups: dict[str, LoRAGroup]) -> torch.Tensor:
        """The final-normed hidden states of `fb.logits_indices`' rows, each fused projection adapted by
        its group in `groups` (the step's own, `lora_groups`, or a captured graph's over static buffers,
        `worker.decode_graphs`, which leaves the LM head outside the graph)."""
        eps = self.cfg.rms_norm_eps
        h = self.w.embed[fb.input_ids]  # the residual stream (a fresh tensor: updated in place)
        if self.native_layers is not None and use_native(h):
            loras = [groups.get(name) for name in self.lora_slices]
            decode = fb.decode if fb.num_decode else None
            prefill = fb.prefill if fb.num_prefill_seqs else None
            down: torch.Tensor | None = decoder_run(
                self.native_layers, h, fb.positions, fb.slot_mapping, fb.num_decode, decode, prefill, loras
            )
        else:
            down = self._layers(h, fb, groups)
        rows = fb.logits_indices
        last_h = h[rows] if down is None else h[rows] + down[rows]
        _, last = add_rms_norm(last_h, None, self.w.norm, eps)
        return last

    def _layers(self, h: torch.Tensor, fb: ForwardBatch, groups: dict[str, LoRAGroup]) -> torch.Tensor | None:
        """The decoder layers one kernel call at a time on the residual stream h (updated in place); the last
        layer's MLP output, not yet added."""
        eps = self.cfg.rms_norm_eps
        down: torch.Tensor | None = None  # the previous layer's MLP output, added with the next norm
        for i, layer in enumerate(self.w.layers):
            h, x = add_rms_norm(h, down, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            self._lora(qkv, x, groups.get("qkv"), i)
            attn = self._attention(qkv, i, fb)
            o = linear(attn, layer.o, layer.o_bias)
            self._lora(o, attn, groups.get("o"), i)
            h, x = add_rms_norm(h, o, layer.post_norm, eps)
            act = self._mlp_act(x, layer, groups.get("gate_up"), i)
            down = linear(act, layer.down, layer.down_bias)
            self._lora(down, act, groups.get("down"), i)
        return down

    def _native_layers(self) -> torch.Tensor | None:
        """The layers' plan for one native call a step (`kernels.decoder_native`) where every linear runs
        on the AMX kernel or every one on oneDNN's, else None (the layers run one kernel call at a time:
        `_layers`). Tools that time or replace `worker.model`'s kernels one by one set `native_layers` to
        None."""
        cfg, kv = self.cfg, self.kv
        layers = [layer_tensors(w, kv.k[i], kv.v[i]) for i, w in enumerate(self.w.layers)]
        if not runs_natively(layers, self.w.embed.dtype):
            return None
        windows = [cfg.window(i) for i in range(len(layers))]
        return decoder_plan(
            layers, windows, self.rope.cos, self.rope.sin, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, scale=self.scale,
        )  # fmt: skip

    def _mlp_act(self, x: torch.Tensor, layer: LayerWeights, group: LoRAGroup | None, i: int) -> torch.Tensor:
        """silu(gate) * up: in the gate/up matmul's own pass where no adapter of the step changes them
        (`kernels.linear.linear_silu_mul`), else after the matmul and its adapters."""
        if group is None and fuses_silu(layer.gate_up):
            return linear_silu_mul(x, layer.gate_up, layer.gate_up_bias)
        gate_up = linear(x, layer.gate_up, layer.gate_up_bias)
        self._lora(gate_up, x, group, i)
        return silu_mul(gate_up)

    def _attention(self, qkv: torch.Tensor, layer: int, fb: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        t = qkv.shape[0]
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        # RoPE on q and k in place (the first `num_heads + num_kv_heads` heads of each row), k and v cached.
        rope_write_kv(
            qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.rope.cos, self.rope.sin, fb.positions,
            k_cache, v_cache, fb.slot_mapping,
        )  # fmt: skip
        q = qkv[:, : cfg.q_size].reshape(t, cfg.num_heads, cfg.head_dim)
        out = torch.empty_like(q)
        nd = fb.num_decode
        window = cfg.window(layer)
        if nd:
            paged_attention_decode(
                out[:nd], q[:nd], k_cache, v_cache, fb.decode, scale=self.scale, sliding_window=window
            )
        if fb.num_prefill_seqs:
            paged_attention_prefill(
                out[nd:], q[nd:], k_cache, v_cache, fb.prefill, scale=self.scale, sliding_window=window
            )
        return out.view(t, cfg.q_size)

    def lora_groups(self, fb: ForwardBatch, lora: LoRAContext | None) -> dict[str, LoRAGroup]:
        """The step's adapted projections by fused output, those no active slot adapts left out."""
        if lora is None or fb.lora is None:
            return {}
        return self.build_groups(lora.stacks, lora.metas, fb.lora)

    def build_groups(
        self, stacks: dict[str, LoRAStack], metas: Mapping[str, LoRABatchMeta], meta: LoRABatchMeta
    ) -> dict[str, LoRAGroup]:
        """Each fused output's group over its modules in `metas` (each projection with its module's meta),
        segmented by `meta`."""
        groups = {}
        for name, slices in self.lora_slices.items():
            projections = tuple(
                LoRAProjection(s.a, s.b, s.scale, s.ranks, offset, metas[module], s.b_pairs)
                for module, offset in slices.items()
                if module in metas
                for s in (stacks[module],)
            )
            if projections:
                groups[name] = LoRAGroup(projections, meta)
        return groups

    @staticmethod
    def _lora(y: torch.Tensor, x: torch.Tensor, group: LoRAGroup | None, layer: int) -> None:
        if group is not None:
            sgmv_group(y, x, group, layer=layer)
