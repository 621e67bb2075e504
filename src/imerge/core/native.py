"""The data plane: the C extension ``imerge.core._native`` and its pure-Python twin, one interface.

The shard receives a push's payload from its socket straight into the worker's
gradient row with the finite check made on each chunk while it is in the
cache (:meth:`DataPlane.recv_into`), and sums the rows into the round's mean in
one pass (:meth:`DataPlane.mean_rows`), both with the GIL released. The C
extension is built by ``pip install`` where a C compiler exists; where it does
not, or ``--data-plane python`` asks, the same calls run in Python and torch
(one log line says which). Both give the same bits: float32 operations in
torch's order, each rounded once.

Pure: imports neither grpc nor redis.
"""
from __future__ import annotations

import importlib
import logging
import math
import socket
from collections.abc import Sequence
from types import ModuleType

import torch

from imerge.core.errors import InvalidArgument

log = logging.getLogger(__name__)

_extension: ModuleType | None
try:
    _extension = importlib.import_module("imerge.core._native")
    _MISSING = ""
except ImportError as exc:  # no compiler at install time, or a build that failed: the Python path runs
    _extension = None
    _MISSING = str(exc)

CHOICES = ("auto", "native", "python")
RECV_DONE, RECV_CLOSED, RECV_TIMEOUT, RECV_PAUSED = 0, 1, 2, 3
PAUSE_S = 0.25  # a native receive returns to Python at least this often (the rate checks)


def native_available() -> bool:
    return _extension is not None


def why_unavailable() -> str:
    """Why the C extension cannot be imported ("" when it can)."""
    return "" if _extension is not None else f"imerge.core._native is not built ({_MISSING})"


class DataPlane:
    """The byte-moving calls, native (``extension`` given) or Python."""

    def __init__(self, extension: ModuleType | None):
        self._native = extension

    @property
    def name(self) -> str:
        return "native" if self._native is not None else "python"

    def recv_into(self, sock: socket.socket, target: memoryview, start: int, check_finite: bool,
                  budget_s: float = PAUSE_S) -> tuple[int, bool, int]:
        """Receive bytes ``start:`` of ``target`` (a contiguous byte view of a tensor's memory; those before
        ``start`` came in earlier calls) from ``sock``; return (bytes received by this call, every float32
        element it completed is finite, state): RECV_DONE when all arrived, RECV_CLOSED when the peer closed
        first, RECV_TIMEOUT when nothing arrived for the socket's timeout, RECV_PAUSED when the call returned
        early (after ``budget_s``; the Python path after each ``recv``) so that the caller checks the sender's
        rate before it calls again. The native path needs a plain socket (a TLS socket's bytes must pass its
        decryption)."""
        if self._native is not None and type(sock) is socket.socket:
            timeout = sock.gettimeout()
            timeout_ms = -1 if timeout is None else max(int(math.ceil(timeout * 1000)), 0)
            count, finite, state = self._native.recv_into(sock.fileno(), _address(target), start, len(target),
                                                          timeout_ms, max(int(budget_s * 1000), 1), check_finite)
            return int(count), bool(finite), int(state)
        return _recv_into_python(sock, target, start, check_finite)

    def mean_rows(self, out: torch.Tensor, rows: Sequence[torch.Tensor], divisor: int) -> bool:
        """``out`` = the rows added in their order, divided by ``divisor`` (all float32, contiguous, the same
        length); return whether every element of ``out`` is finite."""
        numel = out.numel()
        if any(row.numel() != numel or row.dtype != torch.float32 or not row.is_contiguous() for row in rows) or \
                out.dtype != torch.float32 or not out.is_contiguous() or not rows:
            raise InvalidArgument(f"mean_rows: {len(rows)} rows that are not contiguous float32 of {numel} elements")
        if self._native is not None:
            return bool(self._native.mean_rows(out.data_ptr(), [row.data_ptr() for row in rows], numel,
                                               float(divisor)))
        if len(rows) > 1:
            torch.add(rows[0], rows[1], out=out)
        else:
            out.copy_(rows[0])
        for row in rows[2:]:
            out.add_(row)
        out.div_(divisor)
        return _finite(out)


def _address(view: memoryview) -> int:
    """The address of a writable byte view's first byte (a tensor's memory, seen through numpy)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _finite(values: torch.Tensor) -> bool:
    return math.isfinite(float(values.sum(dtype=torch.float32))) or bool(torch.isfinite(values).all())


def _recv_into_python(sock: socket.socket, target: memoryview, start: int,
                      check_finite: bool) -> tuple[int, bool, int]:
    """One ``recv`` (the GIL released while it waits), then the finite check of the elements it completed."""
    if start >= len(target):
        return 0, True, RECV_DONE
    try:
        count = sock.recv_into(target[start:])
    except TimeoutError:
        return 0, True, RECV_TIMEOUT
    if count == 0:
        return 0, True, RECV_CLOSED
    end = start + count
    first, last = start - start % 4, end - end % 4
    finite = not check_finite or last <= first or _finite(torch.frombuffer(target[first:last], dtype=torch.float32))
    return count, finite, RECV_DONE if end == len(target) else RECV_PAUSED


_chosen: dict[str, DataPlane] = {}


def data_plane(choice: str = "auto") -> DataPlane:
    """The data plane ``choice`` names: ``native`` (the C extension; InvalidArgument saying why where it is not
    built), ``python``, or ``auto`` (native where built; one log line when not)."""
    if choice not in CHOICES:
        raise InvalidArgument(f"data plane {choice!r} is not one of {', '.join(CHOICES)}")
    if choice in _chosen:
        return _chosen[choice]
    if choice == "native" and _extension is None:
        raise InvalidArgument(f"--data-plane native: {why_unavailable()}: reinstall with a C compiler "
                              "(gcc or clang) on PATH, or use --data-plane auto")
    if choice == "auto" and _extension is None:
        log.warning("the native data plane is not available (%s): bytes are received and summed in Python "
                    "(slower; install a C compiler and reinstall imerge)", why_unavailable())
    plane = DataPlane(_extension if choice != "python" else None)
    _chosen[choice] = plane
    return plane
