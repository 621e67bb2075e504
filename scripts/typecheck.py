"""Type-check the ``imerge`` package as it is installed, with the mypy settings of ``pyproject.toml``.

setuptools maps the services into the package from ``services/`` (``imerge.ps``
is ``services/ps``), which mypy cannot follow; so the package is assembled as
the wheel lays it out (as ``scripts/lint_imports.py`` does) and checked there,
and each error is reported at its file in this tree. Run
``python scripts/typecheck.py``; the test suite runs it too
(tests/test_types.py). Extra arguments go to mypy.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lint_imports import ROOT, assemble  # noqa: E402

CHECKED = ["imerge"]  # the whole package: every module, none excluded


def source_paths(text: str, root: Path = ROOT) -> str:
    """Error locations in the assembled tree, written as the files of this tree (imerge/ps/x.py: services/ps/x.py)."""
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    # the longest package first: imerge/ps/ before imerge/
    for package, folder in sorted(folders.items(), key=lambda item: -len(item[0])):
        prefix = package.replace(".", "/") + "/"
        text = re.sub(rf"(?m)^{re.escape(prefix)}", folder.rstrip("/") + "/", text)
    return text


def check(tree: Path, extra: list[str] = (), root: Path = ROOT, cache: Path | None = None
          ) -> subprocess.CompletedProcess:
    """Run mypy over the checked packages of an assembled tree, with ``root``'s configuration; with ``cache`` (a
    folder), incrementally: a second check of the same tree rechecks only what changed and what depends on it."""
    packages = [arg for package in CHECKED for arg in ("-p", package)]
    caching = ["--cache-dir", str(cache)] if cache is not None else ["--no-incremental"]
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"), *caching,
                           *packages, *extra], cwd=tree, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MYPYPATH": str(tree)})


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="imerge-types-") as folder:
        result = check(assemble(Path(folder)), argv)
    sys.stdout.write(source_paths(result.stdout + result.stderr))
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
