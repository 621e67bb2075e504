"""The committed gRPC code is exactly what grpcio-tools generates from proto/."""
from __future__ import annotations

from imerge import protogen


def test_generated_code_is_fresh(tmp_path):
    outputs = protogen.generate(output_root=tmp_path)
    assert outputs, "no proto file found"
    stale = []
    for generated in outputs:
        committed = protogen.OUTPUT_ROOT / generated.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != generated.read_bytes():
            stale.append(str(committed))
    assert not stale, f"stale generated code, run `python -m imerge.protogen`: {stale}"


def test_no_pickle_on_the_data_path():
    import re

    pattern = re.compile(r"^\s*(import pickle|from pickle)|pickle\.loads|torch\.load\(", re.MULTILINE)
    roots = [protogen.REPO_ROOT / d for d in ("services", "src", "proto")]
    offenders = [str(p) for root in roots for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
