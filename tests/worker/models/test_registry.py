"""The registry picks a family by `architectures`, then `model_type`, and names what it supports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from worker.config import ModelLoadError
from worker.models import SUPPORTED_ARCHITECTURES, family_for, family_named

SOURCE = Path("ckpt/config.json")


@pytest.mark.parametrize(
    ("raw", "family"),
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "llama"),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "qwen2"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "mistral"),
        # The class that wrote the checkpoint decides, whatever model_type says.
        ({"architectures": ["MistralForCausalLM"], "model_type": "llama"}, "mistral"),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "mistral"}, "qwen2"),
        # The first supported name of several.
        ({"architectures": ["SomethingElse", "LlamaForCausalLM"]}, "llama"),
        # No architectures (missing, null or empty): model_type decides.
        ({"model_type": "mistral"}, "mistral"),
        ({"architectures": None, "model_type": "qwen2"}, "qwen2"),
        ({"architectures": [], "model_type": "llama"}, "llama"),
    ],
    ids=[
        "llama",
        "qwen2",
        "mistral",
        "architectures-over-model-type",
        "architectures-over-model-type-2",
        "first-supported-of-several",
        "model-type-without-architectures",
        "model-type-with-null-architectures",
        "model-type-with-empty-architectures",
    ],
)
def test_family_is_chosen_by_architectures_then_model_type(raw: dict[str, Any], family: str) -> None:
    assert family_for(raw, SOURCE).model_type == family


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "Qwen3ForCausalLM"),
        # A supported model_type does not rescue an unsupported class (a classifier head is no causal LM).
        ({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"}, "ForSequenceClass"),
        ({"model_type": "gemma"}, "model_type 'gemma'"),
        ({}, "model_type None"),
    ],
    ids=["gpt2", "qwen3", "classifier-of-a-supported-type", "gemma-by-model-type", "nothing"],
)
def test_unsupported_checkpoints_name_the_supported_architectures(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        family_for(raw, SOURCE)
    message = str(err.value)
    assert str(SOURCE) in message and named in message
    assert "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM" in message
    assert "model_type llama, qwen2, mistral" in message


def test_every_family_is_registered_by_its_architectures_and_model_type() -> None:
    assert SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
    for name in ("llama", "qwen2", "mistral"):
        family = family_named(name)
        assert family.model_type == name
        assert all(family_for({"architectures": [a]}, SOURCE) is family for a in family.architectures)
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        family_named("gpt2")
