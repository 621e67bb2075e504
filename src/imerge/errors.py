"""The one error hierarchy of IMerge.

Every error the product raises on purpose is an :class:`IMergeError`. Errors
that cross the wire carry a ``status`` (the name of a gRPC status code) so the
PS server translates them at one choke point and the worker's transport turns
a gRPC failure back into the same class.
"""
from __future__ import annotations

EXIT_REJOIN = 75  # EX_TEMPFAIL: a worker left because the job is recovering; restart it and it rejoins


class IMergeError(Exception):
    """Base class of every IMerge error."""


class ConfigError(IMergeError):
    """A configuration value is invalid; ``option`` names the flag."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


class WaitTimeout(IMergeError, TimeoutError):
    """A blocking wait ran out of time; the message says what it waited for."""


class StoreError(IMergeError):
    """The coordinator's store (Redis) failed or holds something unexpected."""


class LayoutMismatchError(IMergeError):
    """Workers disagree about the model layout."""


class PlanError(IMergeError):
    """The coordinator could not publish a usable plan."""


class RequestError(IMergeError):
    """A request the PS rejects; ``status`` is a gRPC status code name."""

    status = "UNKNOWN"

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class NotFound(RequestError):
    status = "NOT_FOUND"


class InvalidArgument(RequestError):
    status = "INVALID_ARGUMENT"


class FailedPrecondition(RequestError):
    status = "FAILED_PRECONDITION"


class AlreadyExists(RequestError):
    status = "ALREADY_EXISTS"


class Unavailable(RequestError):
    status = "UNAVAILABLE"


class DeadlineExceeded(RequestError):
    status = "DEADLINE_EXCEEDED"


class Aborted(RequestError):
    status = "ABORTED"


class RemoteError(RequestError):
    """A call to a PS shard failed; ``address`` names the shard."""

    def __init__(self, message: str, status: str, address: str):
        super().__init__(f"{address}: {message}", status)
        self.address = address


class GenerationChanged(IMergeError):
    """The job moved to a newer generation (a recovery): this process must rejoin from the checkpoint."""

    def __init__(self, message: str, generation: int | None = None):
        super().__init__(message)
        self.generation = generation


class Rejoin(IMergeError):
    """A worker must leave and be restarted (exit code EXIT_REJOIN) to rejoin the recovered job."""


class ChildFailed(IMergeError):
    """A process started by the launcher failed; ``role`` names it."""

    def __init__(self, role: str, message: str):
        super().__init__(f"{role}: {message}")
        self.role = role
