"""`loragate policy validate | train-difficulty | default`, through the top-level command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loragate.cli import main
from policies.default_policy import DEFAULT_POLICY
from policies.difficulty_learned import LearnedEstimator
from policies.document import dump_policy


def test_validate_a_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(dump_policy(DEFAULT_POLICY))
    assert main(["policy", "validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {path}") and "default: filters: serves-model" in out and "alias 'auto'" in out


@pytest.mark.parametrize(
    ("text", "path"),
    [
        pytest.param('{"plugins": [{"type": "nope"}], "profiles": []}', "plugins[0].type", id="bad field"),
        pytest.param("plugins: [", "$", id="not YAML"),
    ],
)
def test_validate_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, path: str
) -> None:
    file = tmp_path / "policy.json"
    file.write_text(text)
    assert main(["policy", "validate", str(file)]) == 1
    assert f"invalid policy at {path}:" in capsys.readouterr().err


def test_train_difficulty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.jsonl"
    lines = [{"prompt": f"prove the theorem {i}", "label": 1} for i in range(20)]
    lines += [{"prompt": f"hello friend {i}", "label": 0, "max_tokens": 8} for i in range(20)]
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "model.json"
    assert (
        main(["policy", "train-difficulty", str(data), "--out", str(out), "--epochs", "5", "--buckets", "64"])
        == 0
    )
    assert "held-out accuracy: 1.000 on 8 examples" in capsys.readouterr().out
    assert LearnedEstimator.load(out).n_buckets == 64


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        pytest.param('{"prompt": 1, "label": 0}\n', [], "data.jsonl:1", id="bad line"),
        pytest.param('{"prompt": "x", "label": 0}\n', [], "at least 2", id="too few examples"),
        pytest.param(None, [], "cannot read", id="missing file"),
        pytest.param('{"prompt": "x", "label": 0}\n' * 3, ["--holdout", "1"], "--holdout", id="bad holdout"),
    ],
)
def test_train_difficulty_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, args: list[str], message: str
) -> None:
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_text(content)
    assert main(["policy", "train-difficulty", str(data), "--out", str(tmp_path / "m.json"), *args]) == 1
    assert message in capsys.readouterr().err


def test_train_without_a_held_out_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "label": 0}\n{"prompt": "b", "label": 1}\n')
    args = [
        "policy",
        "train-difficulty",
        str(data),
        "--out",
        str(tmp_path / "m.json"),
        "--holdout",
        "0",
        "--quiet",
    ]
    assert main(args) == 0
    assert "held-out accuracy: n/a" in capsys.readouterr().out


@pytest.mark.parametrize("as_json", [pytest.param(False, id="yaml"), pytest.param(True, id="json")])
def test_default(capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    assert main(["policy", "default", *(["--json"] if as_json else [])]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == DEFAULT_POLICY
