"""The built-in plugin types: the policy document's `type` field → plugin class.

An immutable mapping built once from the plugin modules (no registry to mutate at run time). A new plugin
is a new module plus one entry in `_ALL`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from policies.filters.healthy import Healthy
from policies.filters.kv_room import KVRoom
from policies.filters.not_draining import NotDraining
from policies.filters.queue_bound import QueueBound
from policies.filters.serves_model import ServesModel
from policies.filters.tenant_allowed import TenantAllowed
from policies.framework import Plugin
from policies.pickers.maximum import MaxPicker
from policies.pickers.round_robin import RoundRobinPicker
from policies.pickers.uniform import UniformPicker
from policies.pickers.weighted_random import WeightedRandomPicker
from policies.scorers.adapter import AdapterScorer
from policies.scorers.cost import CostScorer
from policies.scorers.difficulty import DifficultyScorer
from policies.scorers.load import LoadScorer
from policies.scorers.prefix import PrefixScorer

_ALL: tuple[type[Plugin], ...] = (
    ServesModel,
    Healthy,
    NotDraining,
    QueueBound,
    KVRoom,
    TenantAllowed,
    PrefixScorer,
    AdapterScorer,
    LoadScorer,
    CostScorer,
    DifficultyScorer,
    MaxPicker,
    WeightedRandomPicker,
    RoundRobinPicker,
    UniformPicker,
)

PLUGIN_TYPES: Mapping[str, type[Plugin]] = MappingProxyType({cls.type_name: cls for cls in _ALL})
