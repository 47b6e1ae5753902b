"""`policies/` stays pure: no torch, no gateway or worker code, and every plugin documents itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import policies
from policies.plugin_types import PLUGIN_TYPES

ROOT = Path(policies.__file__).parent
FORBIDDEN = ("torch", "gateway", "worker", "kernels")


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in sorted(ROOT.rglob("*.py"))]
)
def test_module_imports_and_size(path: Path) -> None:
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in FORBIDDEN]
    assert ast.get_docstring(tree), "a module opens with a docstring"
    assert len(path.read_text().splitlines()) < 300


@pytest.mark.parametrize("type_name", sorted(PLUGIN_TYPES))
def test_plugin_module_docstring_explains_parameters(type_name: str) -> None:
    module = sys.modules[PLUGIN_TYPES[type_name].__module__]
    doc = module.__doc__ or ""
    assert doc.startswith(f"`{type_name}`") and "Algorithm" in doc and "Parameters" in doc
    for name in PLUGIN_TYPES[type_name].parameter_names:
        assert name in doc, f"{type_name} does not document {name}"


def test_importing_the_policies_loads_no_torch() -> None:
    code = (
        "import sys, policies.document, policies.cli, policies.prefix_index, policies.fairness;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'gateway', 'worker')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent, timeout=60)
