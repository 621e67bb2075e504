"""The committed gRPC code is exactly what grpcio-tools generates from proto/."""
from __future__ import annotations

from imerge.wire import protogen


def test_generated_code_is_fresh(tmp_path):
    outputs = protogen.generate(output_root=tmp_path)
    assert outputs, "no proto file found"
    stale = []
    for generated in outputs:
        committed = protogen.OUTPUT_ROOT / generated.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != generated.read_bytes():
            stale.append(str(committed))
    assert not stale, f"stale generated code, run `python -m imerge.wire.protogen`: {stale}"


UNSAFE = r"^\s*(import pickle|from pickle|import marshal|import shelve)|pickle\.|(?<![.\w])eval\(|(?<![.\w])exec\(|yaml\.load\(" \
         r"|torch\.load\((?![^)]*weights_only\s*=\s*True)"


def test_no_pickle_eval_or_unsafe_torch_load_anywhere():
    """No pickle, eval/exec, unsafe yaml.load, or torch.load without weights_only=True, in any code of ours."""
    import re

    pattern = re.compile(UNSAFE, re.MULTILINE)
    files = [p for d in ("services", "src", "tests", "examples", "scripts", "deploy")
             for p in (protogen.REPO_ROOT / d).rglob("*.py")]
    offenders = [f"{p}: {m.group(0).strip()}" for p in files if p.name != "test_codegen.py"
                 for m in [pattern.search(p.read_text())] if m]
    assert offenders == []
    assert pattern.search("state = torch.load(path)") and pattern.search("x = eval(text)")
    assert not pattern.search("torch.load(path, weights_only=True)") and not pattern.search("model.eval()")
