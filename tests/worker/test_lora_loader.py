"""PEFT adapter loading: scales, patterns, and clear errors for adapters we cannot serve exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.lora import AdapterError, load_adapter
from worker.models import load_model_config
from worker.modelzoo.make import ZooPaths


def copy_adapter(zoo: ZooPaths, tmp_path: Path, name: str = "attn-r16") -> Path:
    dst = tmp_path / name
    shutil.copytree(zoo.adapter("tiny", name), dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def test_zoo_adapters_load_with_their_scales(zoo: ZooPaths) -> None:
    cfg = load_model_config(zoo.base("tiny"))
    for name in zoo.adapter_names("tiny"):
        path = zoo.adapter("tiny", name)
        conf = json.loads((path / "adapter_config.json").read_text())
        w = load_adapter(name, path, cfg, torch.float32)
        r = conf["r"]
        expected = conf["lora_alpha"] / (r**0.5 if conf.get("use_rslora") else r)
        assert w.rank == r
        assert all(m.scale == pytest.approx(expected) for m in w.modules.values())
        targets = set(conf["target_modules"]) if isinstance(conf["target_modules"], list) else None
        if targets is not None:
            assert set(w.modules) == targets


def test_alpha_pattern_is_folded_per_layer(zoo: ZooPaths, tmp_path: Path) -> None:
    cfg = load_model_config(zoo.base("tiny"))
    path = copy_adapter(zoo, tmp_path)
    plain = load_adapter("p", path, cfg, torch.float32)
    conf = json.loads((path / "adapter_config.json").read_text())
    edit_config(path, alpha_pattern={"layers.1.self_attn.q_proj": conf["lora_alpha"] * 3})
    patterned = load_adapter("p", path, cfg, torch.float32)
    q0, q1 = plain.modules["q_proj"], patterned.modules["q_proj"]
    assert torch.equal(q1.b[0], q0.b[0])
    assert torch.allclose(q1.b[1], q0.b[1] * 3)
    assert torch.equal(patterned.modules["k_proj"].b, plain.modules["k_proj"].b)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no_config", "no adapter_config.json"),
        ("bad_json", "invalid JSON"),
        ("no_weights", "no adapter_model.safetensors"),
        ("corrupt_weights", "unreadable safetensors"),
        ("dora", "DoRA"),
        ("bias", "trained biases"),
        ("not_lora", "is not LORA"),
        ("embedding_key", "unsupported adapter tensor"),
        ("wrong_shape", "do not fit the base model"),
        ("missing_pair", "without its pair"),
        ("nan_weight", "not finite"),
        ("inf_weight", "not finite"),
    ],
)
def test_bad_adapter_files_give_clear_errors(
    zoo: ZooPaths, tmp_path: Path, damage: str, message: str
) -> None:
    cfg = load_model_config(zoo.base("tiny"))
    path = copy_adapter(zoo, tmp_path)
    weights = path / "adapter_model.safetensors"
    if damage == "no_config":
        (path / "adapter_config.json").unlink()
    elif damage == "bad_json":
        (path / "adapter_config.json").write_text("{not json")
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "corrupt_weights":
        weights.write_bytes(b"\x00\x01garbage")
    elif damage == "dora":
        edit_config(path, use_dora=True)
    elif damage == "bias":
        edit_config(path, bias="all")
    elif damage == "not_lora":
        edit_config(path, peft_type="IA3")
    else:
        from safetensors.torch import load_file

        tensors = load_file(str(weights))
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        if damage == "embedding_key":
            tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 4)
        elif damage == "wrong_shape":
            tensors[key] = torch.zeros(tensors[key].shape[0], 7)
        elif damage in ("nan_weight", "inf_weight"):  # one bad value in one layer's lora_B
            b_key = next(k for k in tensors if "v_proj.lora_B" in k)
            tensors[b_key][3, 0] = float("nan") if damage == "nan_weight" else float("inf")
        else:
            del tensors[key]
        save_file(tensors, str(weights))
    with pytest.raises(AdapterError, match=message):
        load_adapter("bad", path, cfg, torch.float32)
