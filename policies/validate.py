"""Path-aware readers for the policy document: each checks one value's type and names it on failure.

Every reader takes the value and its path (`profiles[0].plugins[1].ref`) and returns the value typed, or
raises `PolicyError(path, message)`, so the admin API can answer 400 with the exact field and the CLI
can print it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from policies.framework import PolicyError


def key_path(path: str, key: str | int) -> str:
    """`key_path("plugins", 3) == "plugins[3]"`, `key_path("plugins[3]", "name") == "plugins[3].name"`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise PolicyError(path or "$", f"must be an object with string keys, got {type(value).__name__}")
    return value


def items(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise PolicyError(path, f"must be a list, got {type(value).__name__}")
    return list(value)


def string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PolicyError(path, f"must be a non-empty string, got {value!r}")
    return value


def number(value: Any, path: str, lo: float = float("-inf"), hi: float = float("inf")) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise PolicyError(path, f"must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def positive(value: Any, path: str) -> float:
    result = number(value, path)
    if result <= 0:
        raise PolicyError(path, f"must be > 0, got {value!r}")
    return result


def known_keys(
    value: Mapping[str, Any], path: str, allowed: Iterable[str], required: Iterable[str] = ()
) -> None:
    """Every key of `value` is in `allowed`, and every key in `required` is present."""
    allowed = set(allowed)
    for key in value:
        if key not in allowed:
            raise PolicyError(
                key_path(path, key), f"unknown key (expected one of: {', '.join(sorted(allowed))})"
            )
    for key in required:
        if key not in value:
            raise PolicyError(key_path(path, key), "is required")
