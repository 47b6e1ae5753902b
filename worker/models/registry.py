"""The supported model families, and which one a checkpoint's `config.json` selects.

`architectures` decides first (a checkpoint says which class wrote it; `MistralForCausalLM` stays Mistral
even under `model_type: llama`), and `model_type` only when `architectures` is missing or empty. An
`architectures` list with no supported name is an error rather than a guess from `model_type`: a
`LlamaForSequenceClassification` head is not a causal LM. The registry is an immutable table built from
the family modules; adding a family means a module and a line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from worker.config import ModelLoadError
from worker.models.family import ModelFamily
from worker.models.llama import LLAMA
from worker.models.mistral import MISTRAL
from worker.models.qwen2 import QWEN2

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, QWEN2, MISTRAL)
BY_ARCHITECTURE: Mapping[str, ModelFamily] = MappingProxyType(
    {arch: family for family in FAMILIES for arch in family.architectures}
)
BY_MODEL_TYPE: Mapping[str, ModelFamily] = MappingProxyType({f.model_type: f for f in FAMILIES})
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(BY_ARCHITECTURE)


def _supported() -> str:
    model_types = ", ".join(BY_MODEL_TYPE)
    return f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)} (model_type {model_types})"


def family_for(raw: Mapping[str, Any], source: Path) -> ModelFamily:
    """The family `config.json` (parsed as `raw`, read from `source`) selects; `ModelLoadError` otherwise."""
    architectures = raw.get("architectures")
    if architectures:
        names = architectures if isinstance(architectures, list) else [architectures]
        for name in names:
            if name in BY_ARCHITECTURE:
                return BY_ARCHITECTURE[name]
        raise ModelLoadError(f"{source}: architectures {names} are not supported; {_supported()}")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    raise ModelLoadError(
        f"{source}: no architectures, and model_type {model_type!r} is not supported; {_supported()}"
    )


def family_named(model_type: str) -> ModelFamily:
    """The family registered as `model_type` (a `ModelConfig.model_type`)."""
    if model_type not in BY_MODEL_TYPE:
        raise ModelLoadError(f"model_type {model_type!r} is not supported; {_supported()}")
    return BY_MODEL_TYPE[model_type]
