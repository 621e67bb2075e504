"""A data connection's calls carried out on the connection's own thread, without the event loop.

The common push (a dense fp32 gradient for a row nobody holds or waits for, whose fencing token, where it is
new, lies within the store's clock as the shard last read it) is checked, received into its row and counted
by the connection's thread, which then answers it; where it was the round's last, the thread also averages
and steps the round (:meth:`~.state.Shard.aggregate_here`). The event loop hears of a round only where a
checkpoint may be due at it or the shards must agree on it, not twice per push as when it carried every
push. A pull waits for its blocks' rounds on the thread and sends each block as its round completes. What needs the loop (a row held or waited
for, a retry, a compressed payload, a token to read the store's clock for) goes the loop's way
(:meth:`~.state.Shard.push`), which decides alike: every block's round
(:class:`~imerge.core.blockround.BlockRound`) takes its lock for each event, whichever thread drives it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

from imerge.core.blockround import Aggregate, Retry
from imerge.core.errors import InvalidArgument
from imerge.core.modes import payload_bytes
from imerge.core.rounds import Push

from .block import BlockState
from .pulls import PulledBlock, PullLooks
from .state import Shard


class DirectPayload(Protocol):
    """A push frame's payload, read on the connection's thread."""

    nbytes: int  # what the frame declares

    def read_into(self, target: memoryview, what: str, check_finite: bool) -> bool:
        """Fill ``target`` from the connection; whether its float32 values are all finite (if checked)."""


def push_here(shard: Shard, push: Push, payload: DirectPayload, stream: Any, source: str,
              start: Callable[[BlockState, Aggregate], None]) -> tuple[bool, int] | None:
    """Carry out ``push`` on this thread: (duplicate, workers pushed so far) as :meth:`Shard.push` answers, or
    None where it must go the event loop's way (nothing was read or changed then). ``start`` starts the round's
    aggregation where this push completed it. Refusals raise as the loop's way would."""
    if push.dtype != "float32" or push.nnz >= 0:
        return None
    block = shard.pushed_block(push)
    nbytes = payload_bytes(push.numel, push.dtype, push.nnz)
    if payload.nbytes != nbytes:
        raise InvalidArgument(f"{push.what}: the frame declares {payload.nbytes} bytes of payload, the block's is "
                              f"{nbytes} bytes in the push's encoding")
    row = block.rows[push.worker]
    if not row.try_hold(push.round, stream):
        return None
    try:
        action = shard.offer(block, push)
        if isinstance(action, Retry) or (action.new_token and not shard.token_known(push.fence)):
            return None
        with shard.receiving(block, push) as check:
            finite = payload.read_into(block.row_view(push.worker), push.what, check)
            if check and not finite:
                raise InvalidArgument(f"{push.what}: gradient holds NaN or infinity")
        return False, shard.carry_out(block, block.rounds.counted(push, source), nbytes, start)
    finally:
        row.release()


class Wakeup:
    """What a pull on a connection's thread waits on: a block's round changed (set by the thread that completed
    or failed it, or by the event loop), or the connection ended (the shard stops: ``ended`` says why)."""

    def __init__(self, on_change: Callable[[], None] | None = None, on_wait: Callable[[], None] | None = None
                 ) -> None:
        self._event = threading.Event()
        self._on_change = on_change  # run by the thread that changed the round, before the pull wakes
        self._on_wait = on_wait  # run before the pull waits (it found nothing to send)
        self.ended: BaseException | None = None

    def changed(self) -> None:
        if self._on_change is not None:
            self._on_change()
        self._event.set()

    def end(self, why: BaseException) -> None:
        self.ended = why
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout_s: float) -> bool:
        if self._on_wait is not None:
            self._on_wait()
        woken = self._event.wait(max(timeout_s, 0.0))
        if self.ended is not None:
            raise self.ended
        return woken


def pull_here(shard: Shard, block_ids: Sequence[str], worker: int, round_: int, timeout_s: float, generation: int,
              wakeup: Wakeup) -> Generator[list[PulledBlock], None, None]:
    """As :meth:`Shard.pull_blocks`, waiting on this thread: the blocks as their rounds complete, those that
    completed together at once, in the order asked; DeadlineExceeded after ``timeout_s``."""
    pull = PullLooks(shard, block_ids, worker, round_, timeout_s, generation, time.monotonic)
    with shard.waiting_on(pull.blocks, wakeup.changed):
        while pull.waiting:
            wakeup.clear()  # before the look: a round completing after it sets it again
            if ready := pull.look():
                yield ready
            elif not wakeup.wait(pull.deadline - time.monotonic()):
                raise pull.timed_out()
