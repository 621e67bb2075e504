"""What one request may cost a shard, checked before anything of its size is read or allocated. Pure.

A request names blocks by id: ids are bounded in length, a call names each
block at most once and at most as many blocks as the shard holds, so the
bytes a reply carries are bounded by what the shard holds. Text that came
from a client (ids, options) is clipped before it goes into a log line or an
error message.
"""
from __future__ import annotations

from collections.abc import Sequence

from imerge.core.errors import InvalidArgument, NotFound

MAX_ID_CHARS = 256          # a block id (the planner makes ids of a few dozen characters)
MAX_OPTIONS_CHARS = 16384   # an optimizer's keyword arguments as JSON
MAX_SEGMENTS = 1 << 20      # pieces of model parameters in one block
MAX_ROW_WAITERS = 4         # pushes of one (block, worker) waiting for its row at once
STALLED_S = 1.0             # a push stream silent this long is superseded by a newer push of its row
# concurrent calls on one HTTP/2 connection: well above what workers sharing a connection open (a pull and a push
# per group and shard in flight), since the calls over it queue in the client and a queued push would leave the
# pulls waiting for its round
MAX_STREAMS_PER_CONNECTION = 1024
MAX_EXPORTS = 4             # Export calls in flight on a shard (imerge.save makes one per shard), each holding a block
PARKED_PULLS_PER_BLOCK = 16  # block waits parked on one connection: this many per block the shard holds (at least
MIN_PARKED_PULLS = 256       # this many), room for the workers sharing it and their pulls of rounds ahead


def clip(text: str, limit: int = 120) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def check_id(block_id: str, what: str) -> None:
    if not block_id:
        raise InvalidArgument(f"{what}: empty block id")
    if len(block_id) > MAX_ID_CHARS:
        raise InvalidArgument(f"{what}: block id {clip(block_id, 40)!r} is longer than {MAX_ID_CHARS} characters")


def check_block_ids(block_ids: Sequence[str], held: int, what: str) -> None:
    """A call's block ids: at least one, each at most once, bounded in length, no more than the ``held``
    blocks of the shard (which bounds the bytes of the reply)."""
    if not block_ids:
        raise InvalidArgument(f"{what}: no block_ids")
    if len(set(block_ids)) != len(block_ids):  # the request is at most one message: bounded work
        raise InvalidArgument(f"{what}: a block is asked for twice")
    if len(block_ids) > max(held, 1):  # some are not here: refused before any is looked up
        raise NotFound(f"{what}: {len(block_ids)} block ids, but the shard holds {held} blocks")
    for block_id in block_ids:
        check_id(block_id, what)
