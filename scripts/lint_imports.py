"""Check the architecture contracts of ``.importlinter`` over the ``imerge`` package as it is installed.

setuptools maps the services into the package from ``services/`` (``imerge.ps``
is ``services/ps``), while import-linter reads a package's own folder; so the
package is assembled, as the wheel lays it out, in a temporary folder and
checked there. Run ``python scripts/lint_imports.py``; the test suite runs it
too (tests/test_architecture.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


def assemble(target: Path, root: Path = ROOT) -> Path:
    """Lay out the package under ``target`` as the wheel does, with the contracts beside it."""
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(folders.items()):  # "imerge" first, then its mapped subpackages
        shutil.copytree(root / folder, target / package.replace(".", "/"), ignore=_SKIP, dirs_exist_ok=True)
    shutil.copy(root / ".importlinter", target / ".importlinter")
    return target


def lint(tree: Path) -> subprocess.CompletedProcess:
    """Run lint-imports over an assembled tree."""
    command = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(command), "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tree)})


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="imerge-lint-") as folder:
        result = lint(assemble(Path(folder)))
    sys.stdout.write(result.stdout + result.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
