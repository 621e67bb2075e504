"""The comm queue's policy: one comparator (BytePS-style). Pure.

With priority on, the group the next forward needs first leaves first: groups
are numbered in backward order, so the highest index (the earliest layers)
wins; with priority off the queue is first in, first out. A shard's send
queue (:mod:`imerge.core.sending`) orders its blocks by the same comparator.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any

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
