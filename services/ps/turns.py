"""Which pull's blocks go out on the shard's uplink first: the pull asked first (``--pull-order arrival``, and
``auto`` where one shard holds the job's blocks).

When a round completes, every worker's pull of it wants the shard's uplink at once. Shared evenly, each worker
has its parameters only once all have them, and meanwhile the shard's downlink, which the next round's pushes
need, idles. Served in the order the pulls were asked, the worker that asked first (the one that pushed first)
has its blocks at the uplink's full rate, starts its next iteration and pushes while the next worker's blocks
go out: the pushes and the pulls overlap on the shard's two directions.

The policy is a comparator and a byte credit, as BytePS's scheduled queue: a pull may hand a block to its
connection when no pull asked before it has more than ``low_water`` bytes queued on this host below TCP (the
queueing discipline's and the device's queues, which our uplink drains; :func:`~imerge.wire.datapath.
host_queued_bytes`), nor a block ready that its thread has yet to send (a round's completion wakes its pulls
together: the one asked first sends first, whichever thread runs first). A pull whose path is slower than the
shard's uplink (a worker's congested downlink) keeps its bytes in its socket, not on the host, and holds nobody
back by them. Where the job has several shards, each would serve the same worker first, and that worker's
downlink, fed by all of them, becomes the limit (``imerge bench B2`` at 100 Mbit/s, 3 shards: 2% slower than
leaving the order to TCP): ``auto``, the default, takes turns only where one shard holds the job's blocks. A
block waits at most ``max_wait_s``, after which the pulls it waited for lose their ready mark until they send (a
worker that stops reading holds the others back once, not at every block). Pure: the meters of queued bytes,
the clock and the sleep are given.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

QueuedBytes = Callable[[], int]  # bytes a connection has queued on this host (raises OSError once it is closed)
PULL_ORDERS = ("auto", "arrival", "off")
LOW_WATER_BYTES = 16 << 10  # about 1.3 ms of a 100 Mbit/s uplink: the next pull's block starts as this drains
MAX_WAIT_S = 0.05           # the longest a block waits for its turn (a stalled reader delays others this much)
POLL_S = 0.0003             # how often a waiting block looks again


class PullTurns:
    """The shard's pulls in the order they were asked, each with a meter of its connection's queued bytes."""

    def __init__(self, order: str = "arrival", low_water: int = LOW_WATER_BYTES, max_wait_s: float = MAX_WAIT_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 shards: int = 1):
        if order not in PULL_ORDERS:
            raise ValueError(f"pull order {order!r}: one of {', '.join(PULL_ORDERS)}")
        self.order = order
        self.shards = shards  # the job's shards that hold blocks (the shard sets it once it has read the plan)
        self.low_water, self.max_wait_s = low_water, max_wait_s
        self._clock, self._sleep = clock, sleep
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._sending: dict[object, Turn] = {}  # connection -> its pull that sent last, or has a block ready
        self._waiting: set[int] = set()  # the numbers of the blocks waiting their turn: only the first one polls
        self._moved = threading.Condition(self._lock)  # a waiting block went: the next one polls

    @property
    def enabled(self) -> bool:
        """Whether the pulls take turns: ``arrival``, or ``auto`` with one shard."""
        return self.order == "arrival" or (self.order == "auto" and self.shards <= 1)

    def ask(self, connection: object, queued: QueuedBytes) -> Turn:
        """A pull was asked on ``connection``: its place in the order."""
        return Turn(self, next(self._numbers), connection, queued)

    def _enter(self, turn: Turn, pending: bool) -> None:
        if self.enabled:
            with self._lock:  # a connection's newer pull takes its place (its older one has ended)
                turn.pending = pending
                self._sending[turn.connection] = turn

    def _ahead(self, turn: Turn) -> bool:
        """Whether a pull asked before ``turn`` has a block ready to send, or more than the low water queued on
        the host (the ones drained or closed leave the order: they enter again with their next block)."""
        with self._lock:
            earlier = [other for other in self._sending.values() if other.number < turn.number]
        for other in earlier:
            if other.pending:
                return True
            try:
                if other.queued() > self.low_water:
                    return True
            except OSError:
                pass
            with self._lock:
                if self._sending.get(other.connection) is other and not other.pending:
                    del self._sending[other.connection]
        return False

    def _wait(self, turn: Turn) -> float:
        if not self.enabled:
            return 0.0
        self._enter(turn, pending=False)  # its block goes next: its bytes show in its meter
        if not self._ahead(turn):
            return 0.0
        start = self._clock()
        with self._lock:
            self._waiting.add(turn.number)
        try:
            while self._first_waiting(turn, start) and self._ahead(turn):
                if self._clock() - start >= self.max_wait_s:
                    self._pass_over(turn)
                    break
                self._sleep(POLL_S)
        finally:
            with self._lock:
                self._waiting.discard(turn.number)
                self._moved.notify_all()
        return self._clock() - start

    def _first_waiting(self, turn: Turn, start: float) -> bool:
        """Block (without polling) while a block asked before ``turn``'s waits too: with many workers one thread
        polls, not one per pull. False where ``turn`` waited its longest meanwhile."""
        with self._lock:
            while min(self._waiting) != turn.number:
                left = self.max_wait_s - (self._clock() - start)
                if left <= 0:
                    return False
                self._moved.wait(left)
        return True

    def _pass_over(self, turn: Turn) -> None:
        """``turn`` waited its longest: the earlier pulls whose threads have not sent their ready block by now
        (one stuck in a write to a worker that stopped reading) lose the mark until they send."""
        with self._lock:
            for other in self._sending.values():
                if other.number < turn.number:
                    other.pending = False


class Turn:
    """One pull's place in the order. The thread that completes one of its blocks' rounds marks it ready
    (:meth:`ready`), so that it is in the order before a later pull woken with it sends; before each block it
    sends it waits its turn (:meth:`wait`); where it found nothing to send, or ended, it is no longer ready
    (:meth:`idle`)."""

    def __init__(self, turns: PullTurns, number: int, connection: object, queued: QueuedBytes):
        self._turns = turns
        self.number, self.connection, self.queued = number, connection, queued
        self.pending = False  # a block of it is ready and its thread has yet to send it

    def ready(self) -> None:
        self._turns._enter(self, pending=True)

    def idle(self) -> None:
        self.pending = False

    close = idle  # the pull ended (answered, refused or failed): its bytes still queued keep their place

    def wait(self) -> float:
        """Wait (at most the turns' ``max_wait_s``) until no pull asked before this one has a block ready or
        bytes queued on the host; return the seconds waited."""
        return self._turns._wait(self)
