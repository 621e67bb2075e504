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


def test_each_test_gets_the_tier_of_what_it_starts():
    """The fast tier holds no server and no process: a launcher job is e2e, a shard in the test process is a
    cluster test, a policy unit is unit (the rule is tests/conftest.py's tier_of)."""
    import subprocess
    import sys

    modules = ["tests/test_slot_units.py", "tests/test_launcher.py", "tests/test_deploy.py",
               "tests/test_hostile_clients.py", "tests/test_request_bounds.py", "tests/test_recovery.py"]

    # one collection (each costs seconds of imports): a plugin, after conftest's hook, prints each test's tiers
    plugin = """
import pytest, sys
class Tiers:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            tiers = sorted({m.name for m in item.iter_markers()} & {"unit", "cluster", "e2e"})
            print("TIER", item.nodeid.split("[")[0], ",".join(tiers))
sys.exit(pytest.main(["--collect-only", "-q", *sys.argv[1:]], plugins=[Tiers()]))
"""
    out = subprocess.run([sys.executable, "-c", plugin, *modules], capture_output=True, text=True,
                         timeout=120).stdout
    tiers: dict[str, set[str]] = {}
    for line in out.splitlines():
        if line.startswith("TIER "):
            _, name, marks = line.split(" ", 2)
            tiers.setdefault(name, set()).update(filter(None, marks.split(",")))
    assert tiers and all(len(marks) == 1 for marks in tiers.values()), tiers  # exactly one tier each

    def collected(marker: str) -> set[str]:
        return {name for name, marks in tiers.items() if marker in marks}

    unit, cluster, e2e = collected("unit"), collected("cluster"), collected("e2e")
    assert not unit & cluster and not unit & e2e and not cluster & e2e
    assert any(name.startswith("tests/test_slot_units.py::") for name in unit)
    assert "tests/test_launcher.py::test_launch_two_shards_two_workers_completes" in e2e
    assert "tests/test_deploy.py::test_the_compose_topology_runs_the_demo_job_in_namespaces" in e2e  # a helper's
    assert "tests/test_hostile_clients.py::test_every_refused_push_leaves_the_block_as_it_was" in cluster
    assert "tests/test_request_bounds.py::test_a_huge_block_id_is_refused_and_logged_clipped" in e2e  # a fixture's
    assert not any(name.startswith("tests/test_recovery.py") for name in unit)
