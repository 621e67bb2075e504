"""Whether a client stream makes progress, not just noise: the bytes it moved over time. Pure.

A stream that sends a byte now and then is never silent for ``--stream-idle-s``, yet it can hold a worker's row
for ever. :class:`Pace` keeps the stream's byte count at a few points of the last window and answers how much
it moved lately: a stream that moved less than the minimum rate over a whole window is ended
(:meth:`Pace.too_slow`), and the stream holding a row is superseded by a newer push of that row once it moved
less than the minimum over the last second (:meth:`Pace.stalled`), as a silent one is.

A block's payload, whose size the shard checked before reading it, also has a budget: the time that size takes at
the minimum rate, at least ``STALLED_S`` (:func:`payload_budget_s`). A push that waits for the row supersedes a
holder whose payload has taken longer than that, however it keeps the rate: no client holds a row that another
push of it waits for longer than its block's size at the minimum rate. A holder nobody waits for keeps the
window's rule, so that a real worker's payload stalled for a moment by its network is not ended for it.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable

from imerge.core.limits import STALLED_S

SAMPLES_PER_WINDOW = 16


class Pace:
    def __init__(self, min_bytes_per_s: float, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.min_bytes_per_s, self.window_s, self._clock = min_bytes_per_s, window_s, clock
        self.started = self.last = clock()  # the stream's start, and when it last moved bytes
        self.total = 0
        self._samples: collections.deque[tuple[float, int]] = collections.deque([(self.started, 0)])

    def moved(self, nbytes: int) -> None:
        now = self._clock()
        self.total += nbytes
        self.last = now
        if now - self._samples[-1][0] >= self.window_s / SAMPLES_PER_WINDOW:
            self._samples.append((now, self.total))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
                self._samples.popleft()  # keep one sample at least a window old

    def idle_for(self) -> float:
        return self._clock() - self.last

    def moved_in(self, seconds: float) -> int | None:
        """Bytes moved in the last ``seconds`` (at least: counted from the newest sample that old), or None while
        the stream is younger than that."""
        now = self._clock()
        if now - self.started < seconds:
            return None
        before = next((total for at, total in reversed(self._samples) if now - at >= seconds), 0)
        return self.total - before

    def too_slow(self) -> str:
        """Why the stream is too slow to go on ("" while it keeps the minimum rate over the last window)."""
        if not self.min_bytes_per_s:
            return ""
        moved = self.moved_in(self.window_s)
        if moved is None or moved >= self.min_bytes_per_s * self.window_s:
            return ""
        return (f"the client moved {moved} bytes in the last {self.window_s:g}s, less than "
                f"{self.min_bytes_per_s:g} bytes/s (--stream-min-bytes-per-s)")

    def stalled(self, seconds: float) -> bool:
        """Silent for ``seconds``, or slower than the minimum rate over the last ``seconds``."""
        if self.idle_for() >= seconds:
            return True
        moved = self.moved_in(seconds)
        return bool(self.min_bytes_per_s) and moved is not None and moved < self.min_bytes_per_s * seconds


def payload_budget_s(nbytes: int, min_bytes_per_s: float) -> float | None:
    """How long a payload of ``nbytes`` may take: its size at the minimum rate, at least ``STALLED_S`` (None:
    no minimum rate)."""
    return max(STALLED_S, nbytes / min_bytes_per_s) if min_bytes_per_s else None
