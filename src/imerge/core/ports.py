"""Whether a port can be bound: asked before a server binds it, so that a busy port is one clear error."""
from __future__ import annotations

import socket


def bind_problem(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound ("" when it can, or when the port is 0: any free one)."""
    if port == 0:
        return ""
    address = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((address, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""
