"""The architecture is kept by import-linter (.importlinter), run here; and it fails on a violation."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lint_imports  # noqa: E402


def test_the_import_contracts_are_kept(tmp_path):
    result = lint_imports.lint(lint_imports.assemble(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, code, contract", [
    ("imerge/core/_probe.py", "import grpc\n", "The pure core and the simulator import neither grpc nor redis"),
    ("imerge/core/_probe.py", "from imerge.control import store\n", "Layers"),
    ("imerge/ps/_probe.py", "from imerge.worker import buffers\n", "No service imports another"),
    ("imerge/ops/_probe.py", "from imerge.coordinator import service\n", "The library never imports a service"),
    ("imerge/worker/_probe.py", "import redis\n", "Only the control plane's store issues Redis commands"),
])
def test_a_deliberate_violation_breaks_its_contract(tmp_path, module, code, contract):
    tree = lint_imports.assemble(tmp_path)
    (tree / module).write_text(code)
    result = lint_imports.lint(tree)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and "_probe" in broken, result.stdout


def imports_of(source: str) -> set[str]:
    """Every module a source file imports, with the names ``from X import`` takes (X.name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_pure_core_does_not_import_torch_distributed():
    """import-linter names only top-level external packages, so torch.distributed is checked here."""
    assert "torch.distributed" in imports_of("from torch import distributed as dist\n")
    assert "torch.distributed" in imports_of("import torch.distributed\n")
    offenders = [str(path) for path in (ROOT / "src/imerge/core").glob("*.py")
                 if any(name == "torch.distributed" or name.startswith("torch.distributed.")
                        for name in imports_of(path.read_text()))]
    assert offenders == []
