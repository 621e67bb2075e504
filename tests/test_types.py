"""The package type-checks under mypy --strict (scripts/typecheck.py, settings in pyproject.toml), and a
deliberate type error fails the check naming the file and line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lint_imports  # noqa: E402
import typecheck  # noqa: E402


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, Path]:
    """The package assembled once, and a mypy cache the module's checks share (the second is incremental)."""
    return lint_imports.assemble(tmp_path_factory.mktemp("types")), tmp_path_factory.mktemp("mypy-cache")


def test_the_package_type_checks_strictly(tree):
    folder, cache = tree
    result = typecheck.check(folder, cache=cache)
    assert result.returncode == 0, typecheck.source_paths(result.stdout + result.stderr)
    assert "Success: no issues found" in result.stdout


def test_a_deliberate_type_error_fails_the_check(tree):
    """Shard.fetch annotated as returning the raw frames (tuple[int, list[bytes]]) while it returns a Snapshot: the
    annotation this check was made to catch."""
    folder, cache = tree
    state = folder / "imerge/ps/state.py"
    source = state.read_text()
    correct = "generation: int = 0) -> tuple[int, Snapshot]:\n        self.check_generation(generation, f\"fetch of"
    assert correct in source
    state.write_text(source.replace(correct, correct.replace("tuple[int, Snapshot]", "tuple[int, list[bytes]]")))
    try:
        result = typecheck.check(folder, cache=cache)
    finally:
        state.write_text(source)
    report = typecheck.source_paths(result.stdout)
    assert result.returncode == 1, report
    assert "services/ps/state.py:" in report and "[return-value]" in report, report
    assert 'got "tuple[int, Snapshot]", expected "tuple[int, list[bytes]]"' in report, report
