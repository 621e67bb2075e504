"""The package type-checks under mypy --strict (scripts/typecheck.py, settings in pyproject.toml), and a
deliberate type error fails the check naming the file and line."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lint_imports  # noqa: E402
import typecheck  # noqa: E402


def test_the_package_type_checks_strictly(tmp_path):
    result = typecheck.check(lint_imports.assemble(tmp_path))
    assert result.returncode == 0, typecheck.source_paths(result.stdout + result.stderr)
    assert "Success: no issues found" in result.stdout


def test_a_deliberate_type_error_fails_the_check(tmp_path):
    """Shard.pull annotated as returning the raw frames (tuple[int, list[bytes]]) while it returns a Snapshot: the
    annotation this check was made to catch."""
    tree = lint_imports.assemble(tmp_path)
    state = tree / "imerge/ps/state.py"
    source = state.read_text()
    correct = "generation: int = 0) -> tuple[int, Snapshot]:\n        \"\"\"Wait until every worker pushed"
    assert correct in source
    state.write_text(source.replace(correct, correct.replace("tuple[int, Snapshot]", "tuple[int, list[bytes]]")))
    result = typecheck.check(tree)
    report = typecheck.source_paths(result.stdout)
    assert result.returncode == 1, report
    assert "services/ps/state.py:" in report and "[return-value]" in report, report
    assert 'got "tuple[int, Snapshot]", expected "tuple[int, list[bytes]]"' in report, report
