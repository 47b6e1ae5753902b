"""scripts/codestats: exact counts on a small synthetic tree, the layering rules, and the repository itself.

The script has no `.py` suffix (it is run as `scripts/codestats`), so it is loaded from its path.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "codestats"


def _load() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("codestats", str(SCRIPT))
    spec = importlib.util.spec_from_loader("codestats", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["codestats"] = module  # dataclasses look their module up by name
    loader.exec_module(module)
    return module


codestats = _load()

# gateway/app.py: 12 lines; `serve` 5 lines (def to return), `Handler.handle` 3, `Handler.handle.inner` 2.
APP = """\
import torch
from loragate.contracts import AdapterTier
from policies import framework, types


def serve():
    import json, policies.types

    return json.dumps(AdapterTier)
class Handler:
    def handle(self):
        def inner():
            return 1
"""
# gateway/util.py: 3 lines, one 2-line function, an import inside the package (not an edge).
UTIL = """\
from gateway.app import serve
def noop():
    return serve
"""
# worker/engine.py: imports gateway (forbidden) and torch (fine for a worker).
ENGINE = """\
import torch
from gateway import app
"""
# kernels/ops.py: stdlib, torch, triton and itself are fine; numpy is not.
OPS = """\
from __future__ import annotations
import math
import torch, triton
from kernels import ops
import numpy as np
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    files = {
        "gateway/app.py": APP,
        "gateway/util.py": UTIL,
        "gateway/__pycache__/app.cpython-311.py": "def stale():\n    pass\n",
        "worker/engine.py": ENGINE,
        "kernels/ops.py": OPS,
        "docs/notes.py": "import torch\n",  # not a package: not scanned
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_function_sizes_are_exact_and_qualified(tree: Path) -> None:
    stats = codestats.scan(tree)
    gateway = stats.packages[0]
    assert gateway.package == "gateway"
    assert [(f.name, f.path, f.line, f.lines) for f in gateway.functions] == [
        ("serve", "gateway/app.py", 6, 4),
        ("Handler.handle", "gateway/app.py", 11, 3),
        ("Handler.handle.inner", "gateway/app.py", 12, 2),
        ("noop", "gateway/util.py", 2, 2),
    ]


def test_module_sizes_and_totals(tree: Path) -> None:
    by_name = {p.package: p for p in codestats.scan(tree).packages}
    assert [(m.path, m.lines) for m in by_name["gateway"].module_sizes] == [
        ("gateway/app.py", 13),
        ("gateway/util.py", 3),
    ]
    assert (by_name["gateway"].modules, by_name["gateway"].lines) == (2, 16)
    assert (by_name["kernels"].modules, by_name["kernels"].lines) == (1, 5)
    assert (by_name["policies"].modules, by_name["policies"].lines) == (0, 0)  # missing folder: empty


def test_import_edges_are_counted_per_named_module(tree: Path) -> None:
    stats = codestats.scan(tree)
    assert stats.edges == {
        # app.py: `from loragate.contracts`; `from policies import ...` + `import json, policies.types`
        ("gateway", "loragate"): 1,
        ("gateway", "policies"): 2,
        ("gateway", "torch"): 1,
        ("kernels", "torch"): 1,
        ("kernels", "triton"): 1,
        ("worker", "gateway"): 1,
        ("worker", "torch"): 1,
    }


def test_forbidden_imports_name_file_line_and_rule(tree: Path) -> None:
    found = [(f.importer, f.imported, f.path, f.line) for f in codestats.scan(tree).forbidden]
    assert found == [
        ("gateway", "torch", "gateway/app.py", 1),
        ("worker", "gateway", "worker/engine.py", 2),
        ("kernels", "numpy", "kernels/ops.py", 5),
    ]


@pytest.mark.parametrize(
    ("importer", "imported", "forbidden"),
    [
        pytest.param("gateway", "torch", True, id="gateway-torch"),
        pytest.param("policies", "triton", True, id="policies-triton"),
        pytest.param("gateway", "policies", False, id="gateway-policies"),
        pytest.param("worker", "policies", True, id="worker-policies"),
        pytest.param("worker", "gateway", True, id="worker-gateway"),
        pytest.param("worker", "torch", False, id="worker-torch"),
        pytest.param("kernels", "torch", False, id="kernels-torch"),
        pytest.param("kernels", "kernels", False, id="kernels-itself"),
        pytest.param("kernels", "__future__", False, id="kernels-future"),
        pytest.param("kernels", "math", False, id="kernels-stdlib"),
        pytest.param("kernels", "loragate", True, id="kernels-loragate"),
        pytest.param("kernels", "numpy", True, id="kernels-numpy"),
        pytest.param("loadtest", "torch", False, id="loadtest-anything"),
    ],
)
def test_forbidden_rule(importer: str, imported: str, forbidden: bool) -> None:
    assert (codestats.forbidden_rule(importer, imported) is not None) is forbidden


def test_cli_prints_a_table_and_json_last_line(tree: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tree), "--json", "--top", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1  # forbidden imports exist
    lines = run.stdout.splitlines()
    assert "== gateway: 2 modules, 16 lines, 4 functions" in lines
    assert "      4  serve  (gateway/app.py:6)" in lines
    assert ["worker", "->", "gateway", "1", "FORBIDDEN"] in [line.split() for line in lines]
    assert ["gateway", "->", "policies", "2"] in [line.split() for line in lines]
    data = json.loads(lines[-1])
    assert data["packages"]["gateway"]["longest_functions"] == [
        {"name": "serve", "path": "gateway/app.py", "line": 6, "lines": 4}
    ]
    assert data["packages"]["gateway"]["longest_modules"] == [{"path": "gateway/app.py", "lines": 13}]
    assert {"from": "gateway", "to": "policies", "count": 2} in data["edges"]
    assert len(data["forbidden"]) == 3


def test_repository_has_no_forbidden_imports() -> None:
    run = subprocess.run([str(SCRIPT), "--json"], capture_output=True, text=True, timeout=120)
    data = json.loads(run.stdout.splitlines()[-1])
    assert data["forbidden"] == []
    assert run.returncode == 0
    assert set(data["packages"]) == {"gateway", "policies", "worker", "kernels", "loadtest", "loragate"}
    assert all(p["modules"] > 0 for p in data["packages"].values())
