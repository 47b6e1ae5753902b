"""Where adapters live: a fixed number of device slots (LRU), a byte-bounded host tier, and disk.

The cache *decides* and the caller *acts*: `plan(needed)` says which resident adapters to evict and which
to load into which slot (evictions first, least recently used, never one that is needed this step);
`apply(plan)` copies host weights into the stacked slot buffers that the SGMV kernels read. Host misses
read the adapter from disk (`worker.lora.load_adapter`), which also validates it against the base model.
The host tier stays in host memory (pinned on CUDA, so slot writes are asynchronous copies); the slot
buffers, ranks and scales live on the engine's device, with the ranks mirrored on the host so choosing
a step's active modules never reads the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kernels.backend import use_native
from kernels.sgmv_native import bf16_pairs_ready, write_slot_pairs
from loragate.contracts import AdapterTier
from worker.config import ModelConfig
from worker.device import is_cuda
from worker.lora import AdapterError, LoRAWeights, load_adapter


def _b_pairs(
    layers: int, slots: int, fan_in: int, fan_out: int, rank: int, dtype: torch.dtype, device: str
) -> torch.Tensor | None:
    """Zeros `[L, S, out / 16, ceil(R / 2), 32]` for B in rank pairs (`kernels.sgmv_native.slot_pairs`)
    where the native CPU kernels read them in bf16 (AMX, AVX512-BF16: `bf16_pairs_ready`) and this module's
    shapes let them; None elsewhere. Kept beside B (as much memory again as B) so that no step repacks
    an adapter's B."""
    if not (dtype == torch.bfloat16 and use_native(torch.empty(0, device=device)) and bf16_pairs_ready()):
        return None
    if fan_in % 32 or fan_out % 16:
        return None
    return torch.zeros(layers, slots, fan_out // 16, (rank + 1) // 2, 32, dtype=dtype, device=device)


def _b_stack(
    layers: int, slots: int, fan_out: int, rank: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    """Zeros `[L, S, out, R]`: stored `[L, S, R, out]` and seen through its transpose where the native CPU
    kernels run (their expand's fast layout), plain elsewhere (the Triton kernels want unit last stride)."""
    if use_native(torch.empty(0, device=device)):
        return torch.zeros(layers, slots, rank, fan_out, dtype=dtype, device=device).transpose(2, 3)
    return torch.zeros(layers, slots, fan_out, rank, dtype=dtype, device=device)


@dataclass
class LoRAStack:
    """One target module's weights for every slot: what `sgmv_shrink` / `sgmv_expand` read."""

    a: torch.Tensor  # [L, S, R, in]
    b: torch.Tensor  # [L, S, out, R] (on a CPU, a transposed view of [L, S, R, out]: see `_b_stack`)
    ranks: torch.Tensor  # [S] int64, 0 = slot empty or module not adapted
    scale: torch.Tensor  # [S] float32
    b_pairs: torch.Tensor | None = None  # B in rank pairs, where the native bf16 kernel reads them


@dataclass(frozen=True)
class AdapterPlan:
    evict: tuple[tuple[str, int], ...]
    load: tuple[tuple[str, int], ...]


class AdapterCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        host_bytes: int,
        dtype: torch.dtype,
        device: str,
    ):
        self.cfg, self.num_slots, self.max_rank = cfg, num_slots, max_rank
        self.host_bytes, self.dtype, self.device = host_bytes, dtype, device
        self.paths: dict[str, Path] = {}
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.device_lru: OrderedDict[str, int] = OrderedDict()  # name -> slot, oldest first
        self.pinned: set[str] = set()  # evicted from a tier only when nothing else can make room
        self.stacks = {
            module: LoRAStack(
                a=torch.zeros(cfg.num_layers, num_slots, max_rank, fan_in, dtype=dtype, device=device),
                b=_b_stack(cfg.num_layers, num_slots, fan_out, max_rank, dtype, device),
                ranks=torch.zeros(num_slots, dtype=torch.int64, device=device),
                scale=torch.zeros(num_slots, dtype=torch.float32, device=device),
                b_pairs=_b_pairs(cfg.num_layers, num_slots, fan_in, fan_out, max_rank, dtype, device),
            )
            for module, (fan_in, fan_out) in cfg.module_shapes().items()
        }
        self.host_ranks = {module: [0] * num_slots for module in self.stacks}  # stack.ranks, host copy
        self.host_scale = {module: [0.0] * num_slots for module in self.stacks}  # stack.scale, host copy
        self.tier_events: list[tuple[str, AdapterTier]] = []  # (adapter, new tier) since the last drain
        self.disk_reads = 0  # host-tier misses: adapter read from disk
        self.device_loads = 0  # slot writes: adapter copied from host into a device slot
        self.device_evictions = 0  # adapters dropped from a device slot
        self.host_evictions = 0  # adapters dropped from host memory

    def reset_counters(self) -> None:
        """Zero the counters and drop the undrained tier events (a fresh engine's, after its warm-up)."""
        self.tier_events.clear()
        self.disk_reads = self.device_loads = self.device_evictions = self.host_evictions = 0

    # -- registry -------------------------------------------------------------------------------
    def register(self, name: str, path: Path) -> None:
        if not path.is_dir():
            raise AdapterError(f"adapter {name!r}: {path} is not a directory")
        self.paths[name] = path

    def known(self, name: str) -> bool:
        return name in self.paths

    # -- tiers ----------------------------------------------------------------------------------
    def tier(self, name: str) -> AdapterTier:
        if name in self.device_lru:
            return AdapterTier.DEVICE
        return AdapterTier.HOST if name in self.host else AdapterTier.DISK

    def ensure_host(self, name: str) -> LoRAWeights:
        """The adapter's weights in host memory, read (and validated) from disk on a miss."""
        if name in self.host:
            self.host.move_to_end(name)
            return self.host[name]
        if name not in self.paths:
            raise AdapterError(f"unknown adapter {name!r}")
        weights = load_adapter(name, self.paths[name], self.cfg, self.dtype)
        if weights.rank > self.max_rank:
            raise AdapterError(f"adapter {name!r} has rank {weights.rank} > max_lora_rank {self.max_rank}")
        if is_cuda(self.device):
            weights = pinned(weights)
        self.disk_reads += 1
        self.host[name] = weights
        self.tier_events.append((name, AdapterTier.HOST))
        while sum(w.nbytes for w in self.host.values()) > self.host_bytes and len(self.host) > 1:
            victim = next((n for n in self.host if n not in self.pinned and n != name), None)
            if victim is None:
                break
            del self.host[victim]
            self.host_evictions += 1
            self.tier_events.append((victim, self.tier(victim)))
        return weights

    # -- device slots ---------------------------------------------------------------------------
    def plan(self, needed: Iterable[str]) -> AdapterPlan:
        wanted = list(dict.fromkeys(needed))
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} adapters needed in one step but only {self.num_slots} slots")
        missing = [n for n in wanted if n not in self.device_lru]
        free = sorted(set(range(self.num_slots)) - set(self.device_lru.values()))
        evict: list[tuple[str, int]] = []
        # Least recently used first, pinned adapters last.
        order = sorted(self.device_lru, key=lambda n: n in self.pinned)
        victims = (n for n in order if n not in wanted)
        while len(free) < len(missing):
            victim = next(victims)
            evict.append((victim, self.device_lru[victim]))
            free.append(self.device_lru[victim])
        return AdapterPlan(evict=tuple(evict), load=tuple(zip(missing, free, strict=False)))

    def apply(self, plan: AdapterPlan) -> None:
        for name, slot in plan.evict:
            del self.device_lru[name]
            self.device_evictions += 1
            self.tier_events.append((name, self.tier(name)))
            for module, stack in self.stacks.items():
                stack.ranks[slot] = 0
                self.host_ranks[module][slot] = 0
        for name, slot in plan.load:
            self.device_loads += 1
            self._write_slot(self.ensure_host(name), slot)
            self.device_lru[name] = slot
            self.tier_events.append((name, AdapterTier.DEVICE))

    def acquire(self, needed: Iterable[str]) -> dict[str, int]:
        """Make every needed adapter device-resident; returns name -> slot and refreshes their LRU age."""
        wanted = list(dict.fromkeys(needed))
        self.apply(self.plan(wanted))
        for name in wanted:
            self.device_lru.move_to_end(name)
        return {name: self.device_lru[name] for name in wanted}

    def active_modules(self, slots: Iterable[int]) -> frozenset[str]:
        slot_list = list(slots)
        return frozenset(m for m, ranks in self.host_ranks.items() if any(ranks[s] > 0 for s in slot_list))

    def _write_slot(self, weights: LoRAWeights, slot: int) -> None:
        for module, stack in self.stacks.items():
            stack.a[:, slot].zero_()
            stack.b[:, slot].zero_()
            lora = weights.modules.get(module)
            r = lora.rank if lora is not None else 0
            self.host_ranks[module][slot] = r
            stack.ranks[slot] = r
            if lora is not None:
                stack.a[:, slot, :r].copy_(lora.a, non_blocking=True)
                stack.b[:, slot, :, :r].copy_(lora.b, non_blocking=True)
                stack.scale[slot] = lora.scale
                self.host_scale[module][slot] = lora.scale
            if stack.b_pairs is not None:  # the slot's pairs, zeros past them (all zeros: not adapted)
                write_slot_pairs(stack.b_pairs[:, slot], stack.b[:, slot], r)


def pinned(weights: LoRAWeights) -> LoRAWeights:
    """`weights` in page-locked host memory, which a CUDA copy can read without staging it first."""
    modules = {
        m: replace(lora, a=lora.a.pin_memory(), b=lora.b.pin_memory()) for m, lora in weights.modules.items()
    }
    return replace(weights, modules=modules)
