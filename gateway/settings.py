"""Gateway configuration: a YAML/JSON file plus environment overrides, validated once at start-up.

```yaml
admin_token: change-me            # or $LORAGATE_ADMIN_TOKEN
api_keys: {sk-dev-123: dev}       # API key -> tenant (more can be added at runtime via /admin/keys)
adapter_roots: [/models/adapters] # registered adapter paths must lie under one of these
request_timeout_s: 600
redis_timeout_s: 5                # a request that waits longer for Redis gets a 503
body_timeout_s: 30                # a request body must arrive within this, else 408
header_timeout_s: 10              # the request line and headers must arrive within this, else 408
fair_admission_per_worker: 48     # beyond this many outstanding per worker, tenants queue fairly
# Per-worker queue bounds (429) and routing live in the routing policy (GET/PUT /admin/policy).
```
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class GatewaySettings:
    redis_url: str
    admin_token: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    adapter_roots: tuple[Path, ...] = ()
    request_timeout_s: float = 600.0
    first_event_timeout_s: float = 300.0
    redis_timeout_s: float = 5.0  # longest wait for Redis on a request's path; then 503
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408), on every route
    header_timeout_s: float = 10.0  # the request line and headers must arrive within this (408)
    fair_admission_per_worker: int = 48  # outstanding requests per worker before fair queueing starts
    fair_admission_max_wait_s: float = 30.0
    gateway_id: str = field(default_factory=lambda: f"gw-{os.getpid()}")

    @staticmethod
    def load(redis_url: str, path: Path | None = None, **overrides: Any) -> GatewaySettings:
        raw: dict[str, Any] = {}
        if path is not None:
            text = path.read_text()
            raw = json.loads(text) if path.suffix == ".json" else (yaml.safe_load(text) or {})
        raw.update({k: v for k, v in overrides.items() if v is not None})
        if os.environ.get("LORAGATE_ADMIN_TOKEN"):
            raw["admin_token"] = os.environ["LORAGATE_ADMIN_TOKEN"]
        roots = tuple(Path(p).resolve() for p in raw.pop("adapter_roots", ()))
        keys = {str(k): str(v) for k, v in (raw.pop("api_keys", None) or {}).items()}
        return GatewaySettings(redis_url=redis_url, adapter_roots=roots, api_keys=keys, **raw)
