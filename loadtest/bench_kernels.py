"""Micro-benchmark of the kernels against the naive reference and the obvious alternative.

Each case times the public kernel (`--backend torch`: the torch paths; `native`: the C++ kernels of
`kernels.native`, where they exist, prefill attention staying on torch; `triton`: the Triton kernels,
compiled, on a CUDA device, with the dense linears on cuBLAS) on a realistic step, the
per-token float64 reference of `kernels.reference` ("naive"), and the other batched formulation ("alt"):
gather-bmm for LoRA (each token's adapter weights gathered, one batched matmul), one padded gather
plus torch's masked SDPA for attention (the kernels' previous CPU path), and plain `F.linear` (MKL) for
the dense linears (`kernels.linear`: oneDNN on a packed weight with `native`, `F.linear` with `torch`).
Kernel outputs are checked against the reference before timing. Shapes: hidden 512 (the zoo's `small`)
and 2048, 64–256 tokens, 16 adapters of ranks 8–64 with Zipf popularity and base-model tokens, 8 query /
2 KV heads; SmolLM2's projections and LM head for the linears, and its gate/up with SiLU fused into the
AMX kernel (bf16).

    python -m loadtest.bench_kernels [--threads 1] [--repeats 15] [--quick] [--backend torch|native|triton]
        [--device cuda[:N]]

Inputs are drawn on the CPU (the same numbers on any device) and moved to the device; on CUDA every timed
call is followed by a synchronize, so a figure is the call's launch plus its run.

The last line printed is one JSON object: per case the median times (ms) and the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels import (
    AttentionMeta,
    LoRABatchMeta,
    linear,
    lm_head_argmax,
    lm_head_logits,
    pack_linear_weight,
    pack_lm_head,
    paged_attention_decode,
    paged_attention_prefill,
    sgmv_expand,
    sgmv_shrink,
)
from kernels.backend import BACKEND_ENV, triton_interpreting
from kernels.glue import argmax_rows, silu_mul
from kernels.linear import fuses_silu, linear_silu_mul
from kernels.reference import attention_ref, gather_context, sgmv_expand_ref, sgmv_shrink_ref

RANKS = (8, 16, 32, 64)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Timing:
    name: str
    kernel_ms: float
    naive_ms: float
    alt_ms: float
    max_rel_err: float

    def row(self) -> str:
        vs_naive, vs_alt = self.naive_ms / self.kernel_ms, self.alt_ms / self.kernel_ms
        return (
            f"{self.name:<52} {self.kernel_ms:10.3f} {self.naive_ms:10.2f} {vs_naive:8.1f}x"
            f" {self.alt_ms:10.3f} {vs_alt:8.1f}x"
        )

    def summary(self) -> dict[str, float]:
        return {
            "kernel_ms": round(self.kernel_ms, 4),
            "naive_ms": round(self.naive_ms, 3),
            "alt_ms": round(self.alt_ms, 4),
            "speedup_vs_naive": round(self.naive_ms / self.kernel_ms, 2),
            "speedup_vs_alt": round(self.alt_ms / self.kernel_ms, 2),
            "max_rel_err": float(f"{self.max_rel_err:.2e}"),
        }


def median_ms(fn: Callable[[], object], repeats: int, dev: torch.device = CPU) -> float:
    """The median wall time of `fn` (ms), synchronized on a CUDA device."""

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.cpu(), ref.cpu()
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def zipf_slots(
    num_tokens: int, num_adapters: int, gen: torch.Generator, base_share: float = 0.1
) -> list[int]:
    """Per-token slots, Zipf-popular adapters plus base tokens (-1), grouped by slot as the engine does."""
    zipf = [1.0 / (i + 1) for i in range(num_adapters)]
    weights = torch.tensor([*zipf, sum(zipf) * base_share / (1 - base_share)])
    draws = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    return sorted(int(d) if d < num_adapters else -1 for d in draws)


def lora_case(
    name: str, tokens: int, hidden: int, out: int, dtype: torch.dtype, repeats: int, dev: torch.device
) -> Timing:
    """One adapted projection: shrink then expand, into a column slice of a fused output."""
    gen = torch.Generator().manual_seed(tokens + hidden)
    slots_n, rank = 16, max(RANKS)
    slots = zipf_slots(tokens, slots_n, gen)
    ranks = torch.tensor([RANKS[i % len(RANKS)] for i in range(slots_n)])
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    a = (torch.randn(1, slots_n, rank, hidden, generator=gen) / hidden**0.5).to(dtype)
    b = (torch.randn(1, slots_n, out, rank, generator=gen) / rank**0.5).to(dtype)
    for s, r in enumerate(ranks.tolist()):
        a[0, s, r:] = 0
        b[0, s, :, r:] = 0
    scale = torch.rand(slots_n, generator=gen) + 0.5
    y0 = torch.randn(tokens, 2 * out, generator=gen).to(dtype)
    meta = LoRABatchMeta.from_token_slots(slots, dev)
    token_slots = torch.tensor(slots, device=dev)
    xd, ad, bd, scale_d, y0d, ranks_d = (t.to(dev) for t in (x, a, b, scale, y0, ranks))

    def kernel() -> torch.Tensor:
        y, v = y0d.clone(), xd.new_zeros(tokens, rank)
        sgmv_shrink(v, xd, ad, meta, layer=0, scale=scale_d, ranks=ranks_d)
        sgmv_expand(y, v, bd, meta, layer=0, y_offset=out, ranks=ranks_d)
        return y

    def naive() -> torch.Tensor:
        v = sgmv_shrink_ref(x, a, slots, 0, scale, ranks.tolist())
        return sgmv_expand_ref(y0, v, b, slots, 0, out, ranks.tolist())

    def gather_bmm() -> torch.Tensor:
        idx = token_slots.clamp_min(0)
        keep = (token_slots >= 0).to(dtype)[:, None]
        v = torch.bmm(ad[0].index_select(0, idx), xd[:, :, None])[:, :, 0]
        v = v * (scale_d[idx, None] * keep).to(dtype)
        y = y0d.clone()
        y[:, out:] += torch.bmm(bd[0].index_select(0, idx), v[:, :, None])[:, :, 0]
        return y

    err = rel_err(kernel(), naive())
    return Timing(
        name,
        median_ms(kernel, repeats, dev),
        median_ms(naive, max(3, repeats // 5)),
        median_ms(gather_bmm, max(3, repeats // 3), dev),
        err,
    )


def linear_case(
    name: str, rows: int, k: int, n: int, dtype: torch.dtype, repeats: int, dev: torch.device
) -> Timing:
    """One dense projection of a decode step or a prefill chunk, bias-free (SmolLM2's shapes)."""
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    xd, wd = x.to(dev), w.to(dev)
    packed = pack_linear_weight(wd)
    wide = w.double()

    err = rel_err(linear(xd, packed), F.linear(x.double(), wide))
    return Timing(
        name,
        median_ms(lambda: linear(xd, packed), repeats, dev),
        median_ms(lambda: F.linear(x.double(), wide), max(3, repeats // 5)),
        median_ms(lambda: F.linear(xd, wd), repeats, dev),
        err,
    )


def layers_case(name: str, rows: int, layers: int, repeats: int) -> Timing:
    """A decode step's dense projections over `layers` layers of distinct bf16 weights (SmolLM2's shapes,
    212 MB for 30 layers: read from memory as a step reads them, not from cache): `kernels.linear` on its
    packed weights (the AMX kernel where AMX runs) against oneDNN's packed bf16 matmul (alt) and plain
    `F.linear` (naive); the error is the first layer's q/k/v against float64."""
    gen = torch.Generator().manual_seed(rows + layers)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
    weights = [
        [(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for k, n in shapes] for _ in range(layers)
    ]
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
    ours = [[pack_linear_weight(w) for w in layer] for layer in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]

    def run(fn: Callable[[torch.Tensor, Any], torch.Tensor], packs: list[list[Any]]) -> None:
        for layer in packs:
            for w, (k, _) in zip(layer, shapes, strict=True):
                fn(xs[k], w)

    def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    err = rel_err(linear(xs[576], ours[0][0]), F.linear(xs[576].double(), weights[0][0].double()))
    return Timing(
        name,
        median_ms(lambda: run(linear, ours), repeats, CPU),
        median_ms(lambda: run(F.linear, weights), max(3, repeats // 5), CPU),
        median_ms(lambda: run(onednn_linear, onednn), repeats, CPU),
        err,
    )


def mlp_case(name: str, rows: int, layers: int, repeats: int) -> Timing:
    """A decode step's MLP activations over `layers` layers of distinct bf16 gate/up weights (SmolLM2's
    576 -> 2 x 1536): `kernels.linear.linear_silu_mul` on the weight packed gated (SiLU in the AMX kernel's
    epilogue, where AMX runs; elsewhere the fallback below) against the packed linear then `silu_mul`
    (alt) and `F.linear` then `silu_mul` (naive); the error is the first layer's against float64."""
    gen = torch.Generator().manual_seed(rows + layers + 1)
    inter, k = 1536, 576
    weights = [(torch.randn(2 * inter, k, generator=gen) / k**0.5).bfloat16() for _ in range(layers)]
    x = torch.randn(rows, k, generator=gen).bfloat16()
    gated = [pack_linear_weight(w, gated=True) for w in weights]
    plain = [pack_linear_weight(w) for w in weights]

    def fused(w: Any) -> torch.Tensor:
        return linear_silu_mul(x, w) if fuses_silu(w) else silu_mul(linear(x, w))

    g, u = F.linear(x.double(), weights[0].double()).split(inter, dim=-1)
    err = rel_err(fused(gated[0]), F.silu(g) * u)
    return Timing(
        name,
        median_ms(lambda: [fused(w) for w in gated], repeats, CPU),
        median_ms(lambda: [silu_mul(F.linear(x, w)) for w in weights], max(3, repeats // 5), CPU),
        median_ms(lambda: [silu_mul(linear(x, w)) for w in plain], repeats, CPU),
        err,
    )


def lm_head_case(
    name: str, rows: int, k: int, n: int, dtype: torch.dtype, repeats: int, dev: torch.device
) -> Timing:
    """A greedy step's LM head: the pick fused into the head (`kernels.lm_head`) against oneDNN's matmul
    then `argmax_rows` (alt); the error is the fused kernel's logits against float64."""
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    xd, wd = x.to(dev), w.to(dev)
    head, packed = pack_lm_head(wd), pack_linear_weight(wd)
    wide = w.double()
    err = rel_err(lm_head_logits(xd, head), F.linear(x.double(), wide))
    return Timing(
        name,
        median_ms(lambda: lm_head_argmax(xd, head), repeats, dev),
        median_ms(lambda: F.linear(x.double(), wide).argmax(dim=-1), max(3, repeats // 5)),
        median_ms(lambda: argmax_rows(linear(xd, packed)), repeats, dev),
        err,
    )


def paged_cache(
    ctx_lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator, bs: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """A KV cache holding each sequence's context in shuffled blocks, and the block table."""
    counts = [-(-c // bs) for c in ctx_lens]
    num_blocks = sum(counts) + 4
    k = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for c in counts:
        tables.append(perm[used : used + c])
        used += c
    width = max(counts)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return k, v, table, tables


def padded_sdpa_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    bt: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """The alternative: one gather of every sequence padded to the longest, one masked SDPA."""
    batch, heads, hd = q.shape
    bs, kvh = kc.shape[1], kc.shape[2]
    nb = -(-int(lens.max()) // bs)
    k = kc[bt[:, :nb]].view(batch, nb * bs, kvh, hd).transpose(1, 2)
    v = vc[bt[:, :nb]].view(batch, nb * bs, kvh, hd).transpose(1, 2)
    mask = (torch.arange(nb * bs, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q.view(batch, kvh, heads // kvh, hd), k, v, attn_mask=mask)
    out.copy_(o.reshape(batch, heads, hd))


def decode_case(
    name: str, batch: int, max_ctx: int, dtype: torch.dtype, repeats: int, dev: torch.device
) -> Timing:
    gen = torch.Generator().manual_seed(batch + max_ctx)
    heads, kvh, hd = 8, 2, 64
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen)
    kc, vc, bt, tables = paged_cache(lens.tolist(), kvh, hd, dtype, gen)
    q = torch.randn(batch, heads, hd, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = hd**-0.5

    def naive() -> torch.Tensor:
        rows = []
        for i, c in enumerate(lens.tolist()):
            k, v = gather_context(kc, tables[i], c), gather_context(vc, tables[i], c)
            rows.append(attention_ref(q[i : i + 1], k, v, [c - 1], scale))
        return torch.cat(rows)

    qd, kd, vd, btd, lens_d, out_d = (t.to(dev) for t in (q, kc, vc, bt, lens, out))
    meta = AttentionMeta(btd, lens_d)
    paged_attention_decode(out_d, qd, kd, vd, meta, scale=scale)
    err = rel_err(out_d, naive())
    return Timing(
        name,
        median_ms(lambda: paged_attention_decode(out_d, qd, kd, vd, meta, scale=scale), repeats, dev),
        median_ms(naive, 3),
        median_ms(lambda: padded_sdpa_decode(out_d, qd, kd, vd, btd, lens_d), repeats, dev),
        err,
    )


def prefill_case(
    name: str, q_lens: list[int], prefixes: list[int], dtype: torch.dtype, repeats: int, dev: torch.device
) -> Timing:
    gen = torch.Generator().manual_seed(sum(q_lens) + sum(prefixes))
    heads, kvh, hd = 8, 2, 64
    ctx = [n + p for n, p in zip(q_lens, prefixes, strict=True)]
    kc, vc, bt, tables = paged_cache(ctx, kvh, hd, dtype, gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(int(qsl[-1]), heads, hd, generator=gen).to(dtype)
    out = torch.empty_like(q)
    lens, scale = torch.tensor(ctx), hd**-0.5

    def naive() -> torch.Tensor:
        rows = []
        for i, c in enumerate(ctx):
            k, v = gather_context(kc, tables[i], c), gather_context(vc, tables[i], c)
            rows.append(attention_ref(q[qsl[i] : qsl[i + 1]], k, v, list(range(c - q_lens[i], c)), scale))
        return torch.cat(rows)

    qd, kd, vd, btd, lens_d, qsl_d, out_d = (t.to(dev) for t in (q, kc, vc, bt, lens, qsl, out))
    masks = [
        (torch.arange(c)[None, :] <= torch.arange(c - q_lens[i], c)[:, None]).to(dev)
        for i, c in enumerate(ctx)
    ]

    def masked_sdpa() -> None:
        for i, c in enumerate(ctx):
            k = gather_context(kd, tables[i], c).transpose(0, 1)
            v = gather_context(vd, tables[i], c).transpose(0, 1)
            qi = qd[qsl[i] : qsl[i + 1]].transpose(0, 1)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=masks[i], scale=scale, enable_gqa=True)
            out_d[qsl[i] : qsl[i + 1]] = o.transpose(0, 1)

    meta = AttentionMeta(btd, lens_d, query_start_loc=qsl_d)
    paged_attention_prefill(out_d, qd, kd, vd, meta, scale=scale)
    err = rel_err(out_d, naive())
    return Timing(
        name,
        median_ms(lambda: paged_attention_prefill(out_d, qd, kd, vd, meta, scale=scale), repeats, dev),
        median_ms(naive, 1),
        median_ms(masked_sdpa, repeats, dev),
        err,
    )


def run_cases(repeats: int, quick: bool, dev: torch.device = CPU) -> list[Timing]:
    """The cases; on a GPU also serving-sized ones (an 8B model's hidden size, 256-sequence batches).
    Each row is printed as its case finishes."""
    results = Rows()
    gpu = dev.type == "cuda"
    dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        tag = "fp32" if dtype == torch.float32 else "bf16"
        lora = [
            ("sgmv decode T=64 H=512", 64, 512, 512),
            ("sgmv prefill T=256 H=512", 256, 512, 512),
            ("sgmv prefill T=256 H=2048", 256, 2048, 2048),
            *(
                [
                    ("sgmv decode T=256 H=4096", 256, 4096, 4096),
                    ("sgmv prefill T=2048 H=4096", 2048, 4096, 4096),
                ]
                if gpu
                else []
            ),
        ]
        dense = [
            ("linear decode T=48 576->3072", 48, 576, 3072),
            ("linear decode T=128 576->960", 128, 576, 960),
            ("linear lm-head T=48 576->49152", 48, 576, 49152),
            ("linear prefill T=512 1536->576", 512, 1536, 576),
        ]
        for name, rows, k, n in dense[: 2 if quick else None]:
            results.append(linear_case(f"{name} {tag}", rows, k, n, dtype, repeats, dev))
        if dtype == torch.bfloat16 and dev.type == "cpu" and torch.backends.mkldnn.is_available():
            for rows in (16, 128):
                results.append(
                    layers_case(f"linear 30 layers T={rows} (weights from memory) {tag}", rows, 30, repeats)
                )
                mlp = f"gate/up+SiLU 30 layers T={rows} (weights from memory) {tag}"
                results.append(mlp_case(mlp, rows, 30, repeats))
        heads = [
            ("lm-head greedy T=128 576->49152", 128, 576, 49152),
            ("lm-head greedy T=128 256->32000", 128, 256, 32000),
        ]
        for name, rows, k, n in heads[: 1 if quick else None]:
            results.append(lm_head_case(f"{name} {tag}", rows, k, n, dtype, repeats, dev))
        for name, tokens, hidden, out in lora[: 2 if quick else None]:
            results.append(lora_case(f"{name} {tag}", tokens, hidden, out, dtype, repeats, dev))
        decode = [(64, 512), (128, 1024), *([(256, 2048)] if gpu else [])]
        for batch, ctx in decode[: 1 if quick else None]:
            results.append(
                decode_case(f"attn decode B={batch} ctx<={ctx} {tag}", batch, ctx, dtype, repeats, dev)
            )
        prefill = [([256], [0]), ([128, 64, 64], [384, 0, 512]), *([([1024, 512], [0, 1536])] if gpu else [])]
        for q_lens, prefixes in prefill[: 1 if quick else None]:
            label = f"attn prefill q={q_lens} prefix={prefixes} {tag}"
            results.append(prefill_case(label, q_lens, prefixes, dtype, repeats, dev))
    return results


class Rows(list[Timing]):
    """The timings so far, each printed as it is added (a long run cut short still shows its rows)."""

    def append(self, timing: Timing) -> None:
        if not self:
            print(HEADER, flush=True)
        print(timing.row(), flush=True)
        super().append(timing)


HEADER = f"{'case':<52} {'kernel ms':>10} {'naive ms':>10} {'vs naive':>9} {'alt ms':>10} {'vs alt':>9}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared box)"
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed runs per measurement (median reported)"
    )
    parser.add_argument("--quick", action="store_true", help="fp32 and the smallest cases only")
    parser.add_argument(
        "--backend",
        choices=("torch", "native", "triton"),
        default="torch",
        help="the path measured (triton: compiled, on --device)",
    )
    parser.add_argument("--device", default=None, help="cuda[:N] for --backend triton (its default: cuda)")
    args = parser.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if args.backend == "triton" else "cpu"))
    on_gpu = dev.type == "cuda" and torch.cuda.is_available()
    interpreted = dev.type == "cpu" and triton_interpreting()  # the interpreter: a check, not a timing
    if args.backend == "triton" and not (on_gpu or interpreted):
        parser.error("--backend triton runs on a CUDA device (or the CPU with TRITON_INTERPRET=1)")
    if args.backend != "triton" and dev.type != "cpu":
        parser.error(f"--backend {args.backend} is a CPU path; --device {args.device} needs --backend triton")
    os.environ[BACKEND_ENV] = args.backend  # the path this measures, whatever the caller's setting
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        results = run_cases(args.repeats, args.quick, dev)
    speedups = [r.naive_ms / r.kernel_ms for r in results]
    alt = [r.alt_ms / r.kernel_ms for r in results]
    summary = {
        "backend": args.backend,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": args.threads,
        "cases": {r.name: r.summary() for r in results},
        "geomean_speedup_vs_naive": round(math.exp(sum(map(math.log, speedups)) / len(speedups)), 2),
        "geomean_speedup_vs_alt": round(math.exp(sum(map(math.log, alt)) / len(alt)), 2),
        "max_rel_err": float(f"{max(r.max_rel_err for r in results):.2e}"),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
