"""The expected cost of bringing a request's adapter onto a worker's device, by where it lives now.

Shared by the `adapter` and `cost` scorers, so both read the same three parameters the same way:

    device_s: seconds when the adapter is already in a device slot (default 0).
    host_s: seconds to copy it from host memory into a device slot (default 0.005).
    disk_s: seconds to read it from disk (or the registry's URI) and copy it in (default 0.05).

A request without an adapter (`AdapterTier.NONE`) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from loragate.contracts import AdapterTier
from policies.framework import Plugin

PARAMETER_NAMES = frozenset({"device_s", "host_s", "disk_s"})


@dataclass(frozen=True)
class AdapterLoadCost:
    device_s: float = 0.0
    host_s: float = 0.005
    disk_s: float = 0.05

    @staticmethod
    def from_plugin(plugin: Plugin) -> AdapterLoadCost:
        """Reads `device_s`, `host_s` and `disk_s` from the plugin's parameters (validated, ≥ 0)."""
        default = AdapterLoadCost()
        return AdapterLoadCost(
            plugin.param("device_s", default.device_s, lo=0),
            plugin.param("host_s", default.host_s, lo=0),
            plugin.param("disk_s", default.disk_s, lo=0),
        )

    def seconds(self, tier: AdapterTier) -> float:
        return {
            AdapterTier.NONE: 0.0,
            AdapterTier.DEVICE: self.device_s,
            AdapterTier.HOST: self.host_s,
            AdapterTier.DISK: self.disk_s,
        }[tier]
