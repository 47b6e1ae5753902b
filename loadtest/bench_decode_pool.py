"""Decode attention over a KV pool of a worker's size, on 2 MiB pages against 4 KiB pages, in one run.

A serving step's decode attention reads every running sequence's blocks, which the block manager hands
out from anywhere in a pool of gigabytes: memory-bound, and with 4 KiB pages nearly every 6–12 KiB block
is a TLB miss or three. The worker's CPU pool (`worker.kv_cache`) starts on a 2 MiB boundary and asks for
transparent huge pages (`MADV_HUGEPAGE`); this bench times the native decode kernel over the same
contents in such a pool and in one kept on 4 KiB pages (`MADV_NOHUGEPAGE`), alternated round by round.
Defaults: SmolLM2-135M's attention (30 layers, 9 query / 3 KV heads of 64), 85 sequences of 20–330
tokens (the bench workload's steady decode batch), a 4 GiB pool, 16-token blocks drawn at random.

    python -m loadtest.bench_decode_pool [--dtype float32|bfloat16] [--pool-gib 4] [--rounds 9] [--quick]

The last line printed is one JSON object: medians per pool (`huge_pages_ms`, `small_pages_ms`, per
step of all layers), the bytes read per second, `speedup`, and each pool's share of huge pages as the
kernel gave them (`/proc/self/smaps`: 0 where THP is off).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kernels import AttentionMeta, native, paged_attention_decode
from loadtest.host import host
from worker.kv_cache import HUGE_PAGE, _madvise, _zeros

MADV_NOHUGEPAGE = 15  # <linux/mman.h>
BLOCK = 16


def small_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in a private mapping kept on 4 KiB pages, whatever the host's THP setting."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.from_numpy(np.frombuffer(pages, dtype=np.uint8))
    _madvise()(raw.data_ptr(), nbytes // mmap.PAGESIZE * mmap.PAGESIZE, MADV_NOHUGEPAGE)
    return raw.view(dtype).view(shape)


def smaps_entry(t: torch.Tensor) -> tuple[int, dict[str, str]]:
    """The size of the mapping holding `t`'s first byte and its `/proc/self/smaps` fields (name -> value);
    LookupError if no mapping holds it."""
    addr, lines = t.data_ptr(), Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                fields: dict[str, str] = {}
                for row in lines[i + 1 :]:
                    name, _, value = row.partition(":")
                    if not name or " " in name or "-" in name.split()[0]:
                        break  # the next mapping's header
                    fields[name] = value.strip()
                return hi - lo, fields
    raise LookupError(f"no mapping holds {addr:#x}")


def huge_share(t: torch.Tensor) -> float:
    """The share of `t`'s mapping backed by huge pages (`AnonHugePages` of its `smaps` entry)."""
    size, fields = smaps_entry(t)
    return int(fields.get("AnonHugePages", "0 kB").split()[0]) * 1024 / size


def main(argv: Sequence[str] | None = None) -> int:
    doc = (__doc__ or "").split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_decode_pool", description=doc)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--pool-gib", type=float, default=4.0, help="K and V of all layers together")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seqs", type=int, default=85)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="a 64 MiB pool of 2 layers, 2 rounds (tests)")
    args = ap.parse_args(argv)
    if args.quick:
        args.pool_gib, args.layers, args.rounds = 1 / 16, 2, 2
    if not native.available():
        raise SystemExit("the native CPU kernels are not available here")
    dtype = getattr(torch, args.dtype)
    per_block = 2 * args.layers * BLOCK * args.kv_heads * args.head_dim * dtype.itemsize
    blocks = int(args.pool_gib * 2**30) // per_block
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(20, 331, (args.seqs,), generator=gen)
    need = [-(-int(n) // BLOCK) for n in lens]
    if sum(need) > blocks:
        raise SystemExit(f"a pool of {blocks} blocks cannot hold the {sum(need)} the sequences take")
    order = torch.randperm(blocks, generator=gen)
    tables = torch.zeros(args.seqs, max(need), dtype=torch.long)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = order[used : used + n]
        used += n
    shape = (args.layers, blocks, BLOCK, args.kv_heads, args.head_dim)
    pools = {"huge_pages": (_zeros(shape, dtype, "cpu"), _zeros(shape, dtype, "cpu"))}
    pools["small_pages"] = (small_pages(shape, dtype), small_pages(shape, dtype))
    for t, same in zip(pools["huge_pages"], pools["small_pages"], strict=True):  # the same contents in both
        t.uniform_(-1, 1, generator=gen)
        same.copy_(t)
    q = torch.randn(args.seqs, args.heads, args.head_dim, generator=gen).to(dtype)
    meta = AttentionMeta(tables, lens)
    outs = {name: torch.empty_like(q) for name in pools}
    times: dict[str, list[float]] = {name: [] for name in pools}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, (k, v) in pools.items():
            start = time.perf_counter()
            for layer in range(args.layers):
                paged_attention_decode(outs[name], q, k[layer], v[layer], meta, scale=args.head_dim**-0.5)
            times[name].append(time.perf_counter() - start)
    if not torch.equal(outs["huge_pages"], outs["small_pages"]):
        raise SystemExit("the two pools gave different outputs")
    read = int(lens.sum()) * 2 * args.kv_heads * args.head_dim * dtype.itemsize * args.layers
    med = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "dtype": args.dtype,
        "layers": args.layers,
        "seqs": args.seqs,
        "context_tokens": int(lens.sum()),
        "pool_gib": round(blocks * per_block / 2**30, 3),
        "threads": torch.get_num_threads(),
        **{f"{name}_ms": round(m * 1e3, 2) for name, m in med.items()},
        **{f"{name}_gb_s": round(read / m / 1e9, 2) for name, m in med.items()},
        "speedup": round(med["small_pages"] / med["huge_pages"], 3),
        **{f"{name}_huge_share": round(huge_share(pools[name][0]), 3) for name in pools},
        "huge_page_bytes": HUGE_PAGE,
        "rounds": args.rounds,
        "host": host(),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
