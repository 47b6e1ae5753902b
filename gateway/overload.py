"""Overload protection: bound how long an admitted request waits for a worker, and refuse the excess at
once (429 with `Retry-After`) instead of letting queues, and time to first token, grow without bound.

`judge` decides from a model's `Load` (`gateway.queue_estimate`: requests ahead, drain rate, estimated
wait) and the configured `Limits`:
  * `wait_bound_s`: refuse (`queue_wait_exceeded`) when the estimated wait exceeds it;
  * `max_queued`: per model, refuse (`queue_full`) when that many requests are ahead; per tenant, when
    that many of its requests wait in this gateway's fair queue.
0 = off. They come from the gateway config: defaults, then per-model entries, then per-tenant entries
(`*` = every tenant); a tenant's setting wins over its model's, which wins over the default.
`Retry-After` is the time the backlog needs, at the drain rate, to shrink back under the bound that
refused (whole seconds, at least 1; 1 while the drain rate is unknown).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.queue_estimate import TAIL_Z, Load
from gateway.settings import GatewaySettings

BOUND_KEYS = ("max_queued", "wait_bound_s")
ANY_TENANT = "*"
MAX_RETRY_AFTER_S = 600


@dataclass(frozen=True)
class Bounds:
    """One config entry; None = not set here (the next level decides)."""

    wait_bound_s: float | None = None
    max_queued: int | None = None


def _number(where: str, value: object, integer: bool) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not 0 <= value < math.inf
        or (integer and value != int(value))
    ):
        kind = "a whole number" if integer else "a number"
        raise ValueError(f"{where}: must be {kind} >= 0, got {value!r}")
    return float(value)


def parse_bounds(where: str, raw: object) -> Bounds:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a mapping with keys {', '.join(BOUND_KEYS)}")
    for key in raw:
        if key not in BOUND_KEYS:
            raise ValueError(f"{where}.{key}: unknown key (expected {', '.join(BOUND_KEYS)})")
    wait = raw.get("wait_bound_s")
    queued = raw.get("max_queued")
    return Bounds(
        None if wait is None else _number(f"{where}.wait_bound_s", wait, False),
        None if queued is None else int(_number(f"{where}.max_queued", queued, True)),
    )


def _entries(where: str, raw: object) -> dict[str, Bounds]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a mapping of name -> {{{', '.join(BOUND_KEYS)}}}")
    return {str(name): parse_bounds(f"{where}.{name}", value) for name, value in raw.items()}


@dataclass(frozen=True)
class Limits:
    wait_bound_s: float = 0.0  # default for every model; 0 = no wait bound
    max_queued: int = 0  # default per model; 0 = no count bound
    models: Mapping[str, Bounds] = field(default_factory=dict)
    tenants: Mapping[str, Bounds] = field(default_factory=dict)

    @staticmethod
    def parse(wait_bound_s: object, max_queued: object, models: object, tenants: object) -> Limits:
        """Validated limits; ValueError names the offending key (e.g. `admission_tenants.bob.max_queued`)."""
        return Limits(
            _number("admission_wait_bound_s", wait_bound_s, False),
            int(_number("admission_max_queued", max_queued, True)),
            _entries("admission_models", models or {}),
            _entries("admission_tenants", tenants or {}),
        )

    @staticmethod
    def from_settings(settings: GatewaySettings) -> Limits:
        return Limits.parse(
            settings.admission_wait_bound_s,
            settings.admission_max_queued,
            settings.admission_models,
            settings.admission_tenants,
        )

    def _tenant(self, tenant: str) -> Bounds:
        own, anyone = self.tenants.get(tenant, Bounds()), self.tenants.get(ANY_TENANT, Bounds())
        return Bounds(
            own.wait_bound_s if own.wait_bound_s is not None else anyone.wait_bound_s,
            own.max_queued if own.max_queued is not None else anyone.max_queued,
        )

    def wait_bound(self, tenant: str, model: str) -> float:
        for value in (self._tenant(tenant).wait_bound_s, self.models.get(model, Bounds()).wait_bound_s):
            if value is not None:
                return value
        return self.wait_bound_s

    def model_max_queued(self, model: str) -> int:
        value = self.models.get(model, Bounds()).max_queued
        return self.max_queued if value is None else value

    def tenant_max_queued(self, tenant: str) -> int:
        return self._tenant(tenant).max_queued or 0


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    retry_after_s: int
    estimated_wait_s: float | None

    def error(self) -> APIError:
        headers = {"Retry-After": str(self.retry_after_s)}
        if self.estimated_wait_s is not None:
            headers["x-loragate-estimated-wait-s"] = f"{self.estimated_wait_s:.2f}"
        return APIError(429, self.message, code=self.code, headers=headers)


def whole_seconds(seconds: float) -> int:
    """A `Retry-After` value: whole seconds, at least 1, at most `MAX_RETRY_AFTER_S`."""
    return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds))))


def retry_after(excess_requests: float, drain_rps: float) -> int:
    """Seconds for `excess_requests` to drain at `drain_rps` (1 s when the rate is unknown)."""
    return whole_seconds(excess_requests / drain_rps) if drain_rps > 0 else 1


def judge(limits: Limits, tenant: str, model: str, load: Load) -> Refusal | None:
    """None to admit the request; otherwise why it is refused and when to retry."""
    wait = load.wait_s(tenant)
    tenant_max = limits.tenant_max_queued(tenant)
    own = load.queued.get(tenant, 0)
    if tenant_max and own >= tenant_max:
        # This tenant's requests leave the fair queue about once per waiting tenant's turn.
        turns = max(1, len([n for n in load.queued.values() if n]))
        return Refusal(
            "queue_full",
            f"Too many of your requests are queued for '{model}' ({own}; the limit is {tenant_max}). "
            "Retry later.",
            retry_after((own - tenant_max + 1) * turns, load.drain_rps),
            wait,
        )
    model_max = limits.model_max_queued(model)
    ahead = load.ahead(tenant)
    if model_max and ahead >= model_max:
        return Refusal(
            "queue_full",
            f"'{model}' has {ahead} requests queued (the limit is {model_max}). Retry later.",
            retry_after(ahead - model_max + 1, load.drain_rps),
            wait,
        )
    bound = limits.wait_bound(tenant, model)
    if bound and wait is not None and wait > bound:
        # The most requests ahead (+1) whose estimate stays within the bound: n + z√n = bound · rate.
        fits = (math.sqrt(TAIL_Z**2 / 4 + bound * load.drain_rps) - TAIL_Z / 2) ** 2
        return Refusal(
            "queue_wait_exceeded",
            f"'{model}' is overloaded: the estimated wait is {wait:.1f} s, over the bound of {bound:g} s. "
            "Retry later.",
            retry_after(ahead + 1 - fits, load.drain_rps),
            wait,
        )
    return None
