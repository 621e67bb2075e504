"""Generated gRPC code (python -m imerge.wire.protogen); never edit by hand."""
