"""Generate the gRPC Python code in ``imerge.wire.rpc`` from ``proto/``.

Run ``python -m imerge.wire.protogen`` after editing a ``.proto`` file. The
generated files are committed and never edited by hand; a test regenerates
them into a temporary folder and fails when the committed copies are stale.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "proto"
OUTPUT_ROOT = REPO_ROOT / "src"


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(proto_root.rglob("*.proto"))


def generated_names(proto: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    stem = proto.relative_to(proto_root).with_suffix("")
    return [stem.parent / f"{stem.name}_pb2.py", stem.parent / f"{stem.name}_pb2_grpc.py",
            stem.parent / f"{stem.name}_pb2.pyi"]


def generate(output_root: Path = OUTPUT_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) over every proto file; return the outputs."""
    from grpc_tools import protoc  # a build-time dependency only
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    outputs: list[Path] = []
    for proto in proto_files(proto_root):
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{include}",
                f"--python_out={output_root}", f"--pyi_out={output_root}",
                f"--grpc_python_out={output_root}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        outputs += [output_root / name for name in generated_names(proto, proto_root)]
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=OUTPUT_ROOT, help="output root (default: src/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
