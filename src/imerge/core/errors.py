"""The one error hierarchy of IMerge.

Every error the product raises on purpose is an :class:`IMergeError`, and every
decision about an error reads its class attributes, never its message:

* ``recoverable``: the job can go on from its last checkpoint without this
  process (a peer died, froze or was cut off; the job moved to a new
  generation). A worker that meets a recoverable error reports it and exits
  with :data:`EXIT_REJOIN`, so it is restarted and rejoins. Any other
  :class:`IMergeError` is fatal: the worker reports it as fatal, the
  coordinator ends the job with that message and no recovery is tried, and
  the worker exits with :data:`EXIT_FATAL`, which no supervisor restarts.
* ``status`` (on :class:`RequestError` and its subclasses): the name of the
  gRPC status code the class travels as. A shard turns a :class:`RequestError`
  into its status at one choke point and names the class in the call's
  trailing metadata; the worker's client turns it back into the same class
  (``imerge.wire.status``), so a refusal keeps its type across the wire.
  Failures that gRPC itself reports (an unreachable shard, a deadline) come
  back as the class of their status code.
"""
from __future__ import annotations

EXIT_REJOIN = 75  # EX_TEMPFAIL: the job is recovering; restart this worker and it rejoins
EXIT_FATAL = 76   # EX_PROTOCOL: the job cannot go on; restarting this worker would fail the same way


class IMergeError(Exception):
    """Base class of every IMerge error."""

    recoverable = False


class ConfigError(IMergeError):
    """A configuration value is invalid; ``option`` names the flag."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


class UnsupportedUse(IMergeError):
    """A use of the wrapped model that IMerge does not support, refused where it would train wrongly."""


class JobTaken(IMergeError):
    """Another run (another token) holds the job's name in this Redis: this process must not touch its keys."""


class RankInUse(IMergeError):
    """Another live process holds this worker's rank in the job (a rank lease it keeps renewing)."""


class WaitTimeout(IMergeError, TimeoutError):
    """A blocking wait for another role ran out of time; the message says what it waited for.

    Recoverable: the late role is lost, and the job may go on from its checkpoint without it.
    """

    recoverable = True


class StoreError(IMergeError):
    """The coordinator's store (Redis) failed or holds something unexpected."""


class LayoutMismatchError(IMergeError):
    """Workers disagree about the model layout."""


class PlanError(IMergeError):
    """The coordinator could not publish a usable plan."""


class JobFailed(IMergeError):
    """The job ended for good (a fatal error somewhere, or a failure it could not recover from)."""


class RequestError(IMergeError):
    """A request a shard refused, or a call to a shard that failed.

    ``status`` is the gRPC status code name it travels as; ``address`` names the shard once the
    error reached a client.
    """

    status = "UNKNOWN"

    def __init__(self, message: str, address: str = ""):
        super().__init__(f"{address}: {message}" if address else message)
        self.address = address


class ProtocolError(RequestError):
    """A request that breaks the protocol (malformed, out of order, for a block or round that cannot be):
    a bug or a bad input, which no recovery can fix."""


class InvalidArgument(ProtocolError):
    status = "INVALID_ARGUMENT"


class FailedPrecondition(ProtocolError):
    """A well-formed request that does not fit the shard's state (a round it is not at, a block it does not
    own)."""

    status = "FAILED_PRECONDITION"


class NotFound(ProtocolError):
    status = "NOT_FOUND"


class AlreadyExists(ProtocolError):
    status = "ALREADY_EXISTS"


class PermissionDenied(ProtocolError):
    """A request its client's certificate does not entitle it to (strict worker identity)."""

    status = "PERMISSION_DENIED"


class ResourceExhausted(ProtocolError):
    status = "RESOURCE_EXHAUSTED"


class Internal(RequestError):
    """The shard failed on a request (a bug); the job stops rather than repeat it."""

    status = "INTERNAL"


class Unavailable(RequestError):
    """The shard cannot be reached (dead, restarting, cut off) or is shutting down."""

    status = "UNAVAILABLE"
    recoverable = True


class Busy(Unavailable):
    """The shard has no room for another data connection now (its table is full of workers' connections): the
    worker's client tries again within its call's timeout, and only then gives up as the shard being
    unavailable."""


class DeadlineExceeded(RequestError):
    """A call ran past its deadline: a peer is late or lost."""

    status = "DEADLINE_EXCEEDED"
    recoverable = True


class Cancelled(RequestError):
    """A call was cancelled (its shard or this process is shutting down)."""

    status = "CANCELLED"
    recoverable = True


class Fenced(RequestError):
    """A push under a slot flag whose lease had passed to another holder: take the flag again and retry."""

    status = "ABORTED"
    recoverable = True


class Superseded(RequestError):
    """A push stream ended because a newer push of the same block, worker and round arrived (a retry after a
    stall, or a stray client): the newer one is received."""

    status = "ABORTED"
    recoverable = True


class GenerationChanged(RequestError):
    """The job is at another generation than the request's (a recovery): rejoin from the checkpoint. ABORTED,
    as gRPC advises for a retry at a higher level: the code alone says recoverable, trailer or not."""

    status = "ABORTED"
    recoverable = True

    def __init__(self, message: str, generation: int | None = None, address: str = ""):
        super().__init__(message, address)
        self.generation = generation


class StaleGeneration(GenerationChanged):
    """The request is of an older generation than the job's (the job recovered without this process)."""


class FutureGeneration(GenerationChanged):
    """The request is of a newer generation than the shard serves (it has not restored that one yet)."""

    status = "UNAVAILABLE"


class Rejoin(IMergeError):
    """A worker must leave and be restarted (exit code EXIT_REJOIN) to rejoin the recovered job."""

    recoverable = True


class ChildFailed(IMergeError):
    """A process started by the launcher failed; ``role`` names it."""

    def __init__(self, role: str, message: str):
        super().__init__(f"{role}: {message}")
        self.role = role


def request_error_classes() -> dict[str, type[RequestError]]:
    """Every RequestError class by name: what a client may rebuild from a shard's trailing metadata."""
    found: dict[str, type[RequestError]] = {}
    pending: list[type[RequestError]] = [RequestError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found
