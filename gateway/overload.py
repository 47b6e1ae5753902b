"""Overload protection: bound how long an admitted request waits for a worker, and refuse the excess at
once (429 with `Retry-After`) instead of letting queues, and time to first token, grow without bound.

Requests ahead. A new request for model m from tenant t waits behind
  * the requests already on m's workers that are not running yet: Σ over its live workers of
    max(0, outstanding − running) (outstanding from the fleet snapshot, running from the heartbeat), and
  * the requests that leave this gateway's fair queue before it: the tenant's own queued ones plus, from
    every other waiting tenant u, min(queued_u, queued_t + 1). The fair queue serves backlogged tenants
    in turn, so a tenant that floods waits behind its own backlog, and a light tenant is not refused
    because of somebody else's flood.

Drain rate: requests of m finished per second, the larger of two lower bounds:
  * measured here (`DrainMeter`): requests this gateway saw finish in the last `window_s` seconds divided
    by the window (the gateway's age while it is younger). Idle time in the window can only make it low;
    it matters only when there is a backlog, i.e. while the workers are saturated. An empty window keeps
    the last rate measured, so a burst after a quiet spell is not admitted blind;
  * from the heartbeats: Σ decode_tok_s of m's workers / completion tokens per request (the mean measured
    here; before anything finished, the mean `max_tokens` asked for, an upper bound). It counts the work
    of every gateway sharing the fleet, which the local measure misses.
The estimated wait is a high quantile, not the mean, so that admitted requests, not just the average
one, start within the bound: with k requests ahead, every slot is taken and the request starts at the
(k+1)-th completion; were completions a Poisson stream at the drain rate r, that time would be Gamma
distributed with mean n/r (n = k+1) and standard deviation √n/r, so the estimate is (n + 2√n) / r (about
its 97th percentile; 0 with nothing ahead). It also covers completions that come in bunches (identical
requests started together) and a snapshot one or two requests behind. While neither rate is known
(nothing has finished yet) the wait bound is not applied; the count bounds are.

Bounds, from the gateway config: `wait_bound_s` (refuse when the estimated wait exceeds it) and
`max_queued` (per model: requests ahead; per tenant: its requests queued in this gateway); 0 = off.
Defaults, then per-model entries, then per-tenant entries (`*` = every tenant): a tenant's setting wins
over its model's, which wins over the default. `Retry-After` is the time the backlog needs, at the
drain rate, to shrink back under the bound that refused (whole seconds, at least 1).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.fleet import WorkerView
from gateway.settings import GatewaySettings

BOUND_KEYS = ("max_queued", "wait_bound_s")
ANY_TENANT = "*"
MAX_RETRY_AFTER_S = 600
TAIL_Z = 2.0  # standard deviations of the wait added to its mean (see the module docstring)


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


class DrainMeter:
    """Requests of one model finished per second, as this gateway saw them (see the module docstring)."""

    def __init__(self, now: float, window_s: float = 10.0):
        self.started, self.window_s = now, window_s
        self._done: deque[tuple[float, int]] = deque()  # (when, completion tokens)
        self._tokens = 0  # completion tokens in the window
        self._last_rate = 0.0
        self._last_tokens: float | None = None
        self._asked: float | None = None  # moving mean of max_tokens asked for

    def asked(self, max_tokens: int) -> None:
        self._asked = max_tokens if self._asked is None else 0.95 * self._asked + 0.05 * max_tokens

    def finished(self, now: float, completion_tokens: int) -> None:
        self._done.append((now, completion_tokens))
        self._tokens += completion_tokens
        self.rate(now)  # keeps the figures of the last window that held anything

    def _expire(self, now: float) -> None:
        while self._done and self._done[0][0] < now - self.window_s:
            self._tokens -= self._done.popleft()[1]

    def rate(self, now: float) -> float:
        """Requests per second; 0.0 while nothing has finished yet."""
        self._expire(now)
        if self._done:
            span = min(self.window_s, max(now - self.started, 1e-3))
            self._last_rate = len(self._done) / span
            self._last_tokens = self._tokens / len(self._done)
        return self._last_rate

    def tokens_per_request(self, now: float) -> float | None:
        self.rate(now)
        return self._last_tokens if self._last_tokens is not None else self._asked


def backlog(workers: Iterable[WorkerView]) -> int:
    """Requests on these workers that are not running yet (queued in Redis or waiting in an engine)."""
    return sum(max(0, w.load - w.state.running) for w in workers)


def fleet_rate(workers: Iterable[WorkerView], tokens_per_request: float | None) -> float:
    """Requests per second the workers finish by their heartbeats' decode rates; 0.0 when unknown."""
    if not tokens_per_request:
        return 0.0
    return sum(w.state.decode_tok_s for w in workers) / max(1.0, tokens_per_request)


@dataclass(frozen=True)
class Load:
    """What admission sees of one model at one instant."""

    backlog: int  # requests on its workers not running yet
    queued: Mapping[str, int]  # this gateway's fair queue: tenant -> requests waiting
    drain_rps: float  # requests finished per second; 0.0 = unknown

    def ahead(self, tenant: str) -> int:
        """Requests served before a new one of `tenant` (the fair queue's turns, see the docstring)."""
        own = self.queued.get(tenant, 0)
        others = sum(min(n, own + 1) for t, n in self.queued.items() if t != tenant)
        return self.backlog + own + others

    def wait_s(self, tenant: str) -> float | None:
        """Estimated queue wait of a new request (the high quantile of the module docstring); None when the
        drain rate is unknown. With nothing ahead it may find a free slot: 0."""
        if self.drain_rps <= 0:
            return None
        n = self.ahead(tenant) + 1  # it starts when the n-th request from now ends
        return (n + TAIL_Z * math.sqrt(n)) / self.drain_rps if n > 1 else 0.0


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
