"""The comm queue's policy: one comparator (BytePS-style). Pure.

With priority on, the group the next forward needs first leaves first: groups
are numbered in backward order, so the highest index (the earliest layers)
wins; with priority off the queue is first in, first out. A shard's sender
takes blocks off its queue up to a byte credit per push stream.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any

SEND_CREDIT = 4 << 20  # a sender's push stream carries the queued blocks up to this many bytes
PUSHES_IN_FLIGHT = 2   # a sender's push streams whose reply is awaited (1 while slots hold a flag until the reply)
STOP = -(1 << 30)      # the group index of the item that stops a consumer: taken after every queued sync, with
# priority (the lowest) or without (the last put)


class CommQueue:
    def __init__(self, priority: bool):
        self.priority = priority
        self._heap: list[tuple[int, int, Any]] = []
        self._sequence = itertools.count()

    def key(self, group_index: int) -> int:
        return -group_index if self.priority else 0

    def put(self, group_index: int, item: Any) -> None:
        heapq.heappush(self._heap, (self.key(group_index), next(self._sequence), item))

    def pop(self) -> Any:
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)
