"""A simulated worker's adapter tiers: device slots and host memory, both LRU, with disk behind them.

An adapter on the device stays in host memory too (as the real worker's `worker.adapter_cache` keeps it).
Making an adapter resident needs a device slot whose adapter no running sequence uses; if every slot's
adapter is in use the request waits (and later requests may pass it, as in vLLM's scheduler).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

Source = Literal["device", "host", "disk"]  # where an adapter was when a step needed it


class AdapterTiers:
    def __init__(self, max_loras: int, host_adapters: int):
        """`host_adapters >= max_loras` (`EngineModel` checks it)."""
        self.max_loras, self.host_adapters = max_loras, host_adapters
        self.device: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.host: OrderedDict[str, None] = OrderedDict()

    def acquire(self, adapter: str, in_use: set[str | None]) -> Source | None:
        """Make `adapter` device-resident; returns where it was, or None when no slot can be freed (every
        device adapter is in `in_use`)."""
        if adapter in self.device:
            self.device.move_to_end(adapter)
            self.host.move_to_end(adapter)
            return "device"
        if len(self.device) >= self.max_loras:
            victim = next((a for a in self.device if a not in in_use), None)
            if victim is None:
                return None
            del self.device[victim]
        self.device[adapter] = None
        if adapter in self.host:
            self.host.move_to_end(adapter)
            return "host"
        self.host[adapter] = None
        while len(self.host) > self.host_adapters:
            victim = next(a for a in self.host if a not in self.device)
            del self.host[victim]
        return "disk"
