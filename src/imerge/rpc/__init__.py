"""Generated gRPC code (python -m imerge.protogen); never edit by hand."""
