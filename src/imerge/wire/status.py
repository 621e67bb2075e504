"""Errors across the wire: a :class:`RequestError` becomes a gRPC status and comes back as the same class.

The shard aborts a call with the class's status code and names the class in
the trailing metadata (``imerge-error``); the client rebuilds that class. Each
code carries one decision: the classes that share a code (ABORTED: ``Fenced``,
``Superseded``, ``StaleGeneration``; UNAVAILABLE: ``Unavailable``,
``FutureGeneration``) are all recoverable, and every fatal class has a code of
its own, so a failure without the metadata (one gRPC itself reports, or a proxy
that drops trailers) becomes the class of its status code and is still decided
right: recoverable stays recoverable and fatal stays fatal.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import grpc

from imerge.core.errors import (AlreadyExists, Cancelled, DeadlineExceeded, FailedPrecondition, Fenced, Internal,
                                InvalidArgument, NotFound, PermissionDenied, RequestError, ResourceExhausted,
                                Unavailable, request_error_classes)

ERROR_KEY = "imerge-error"
_BY_CLASS = request_error_classes()
_BY_STATUS: dict[grpc.StatusCode, type[RequestError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.ABORTED: Fenced,  # recoverable, as every class that travels as ABORTED
}


def status_of(exc: RequestError) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code ``exc`` travels as, and the trailing metadata naming its class."""
    return grpc.StatusCode[exc.status], ((ERROR_KEY, type(exc).__name__),)


def error_from(exc: grpc.RpcError, address: str) -> RequestError:
    """The IMerge error a failed call stands for, naming the shard at ``address``."""
    code = exc.code()
    details = exc.details() or code.name
    trailer = cast(Iterable[tuple[str, str | bytes]], exc.trailing_metadata() or ())  # aio: (key, value) pairs
    named = next((str(value) for key, value in trailer if key == ERROR_KEY), None)
    cls = _BY_CLASS.get(named) if named else None
    if cls is None or cls.status != code.name:  # no (or a foreign) class name: go by the status code
        cls = _BY_STATUS.get(code, RequestError)
    return cls(details, address=address)
