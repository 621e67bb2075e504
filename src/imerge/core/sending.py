"""The sending schedule: which blocks each push stream to a shard carries, and when. Pure, without I/O.

The worker's comm thread (asyncio, ``services/worker/pushes.py``) and the
simulator (SimPy, :mod:`imerge.sim.psjob`) are two drivers of this one kernel:
each tells :class:`Senders` what happened (a group's sync was taken off the
comm queue, a stream's data was written, a shard answered a stream) and carries
out the streams it returns. The decisions are all here:

* the push order of a group's blocks (:meth:`SendPolicy.push_order`): with
  priority, the reverse of backward order, the order the next forward needs
  them, the same on every worker;
* one queue per shard, ordered by the comm queue's comparator
  (:class:`~imerge.core.queue.CommQueue`): a stream takes the queued blocks of
  any groups, highest priority first, until it carries SEND_CREDIT bytes;
* a shard's next stream starts when the previous one's data is written (its
  reply is not awaited: the round trip would leave the link idle) and fewer
  than :attr:`SendPolicy.streams_in_flight` are unanswered (one while a slot
  flag is held until the reply);
* with slots scoped to (group, shard), a group is pushed whole, one shard after
  another, worker ``w`` starting at its ``w``-th shard (:meth:`SendPolicy.shard_order`),
  so the workers take the shards' ports in turn.

With ``trace`` set, :class:`Senders` records every event it was told and the
streams it returned; :func:`replay` feeds such a trace through another
``Senders`` and returns what it decided, so a run of the worker and the
simulator can be checked to make the same decisions.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from .queue import CommQueue

SEND_CREDIT = 4 << 20  # a sender's push stream carries the queued blocks up to this many bytes
PUSHES_IN_FLIGHT = 2   # a sender's push streams whose reply is awaited (1 while slots hold a flag until the reply)

Tag = TypeVar("Tag")      # what the driver knows a sync by (the worker's pushes of one sync, the simulator's Sync)
B = TypeVar("B")          # a block as the driver holds it (the worker's Block, the simulator's block index)
K = TypeVar("K", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class SendPolicy:
    """The knobs of the sending schedule a worker runs with."""

    priority: bool
    holds_flags: bool = False  # slots take flags (a policy other than off, with a width below the worker count)
    slot_scope: str = "group"
    rank: int = 0

    @property
    def per_group(self) -> bool:
        """Whether a group is pushed whole, shard after shard, under its (group, shard) flags."""
        return self.holds_flags and self.slot_scope == "group"

    @property
    def streams_in_flight(self) -> int:
        """Push streams per shard whose reply may be awaited at once (a flag is held until the reply)."""
        return 1 if self.holds_flags else PUSHES_IN_FLIGHT

    def push_order(self, blocks: Iterable[B], offset_of: Callable[[B], int]) -> list[B]:
        """With priority, a group's blocks in the order the next forward needs them (the reverse of backward
        order: the highest offset first), so every shard completes the earliest layers' blocks first."""
        return sorted(blocks, key=lambda block: -offset_of(block)) if self.priority else list(blocks)

    def shard_order(self, shards: Iterable[K]) -> list[K]:
        """The shards of a group pushed whole, in turn: in increasing order, worker ``rank`` starting at its
        ``rank mod n``-th, so the workers do not all queue for the same shard's port."""
        ordered = sorted(shards)  # type: ignore[type-var]
        start = self.rank % len(ordered) if ordered else 0
        return ordered[start:] + ordered[:start]


@dataclasses.dataclass(frozen=True, eq=False)
class Stream(Generic[Tag, B]):
    """One push stream to ``shard``: the blocks it carries, each with the sync it is of, in the order sent."""

    number: int
    shard: int
    items: tuple[tuple[Tag, B], ...]


@dataclasses.dataclass(eq=False)
class _Sender:
    queue: CommQueue
    writing: bool = False  # a stream's data is still being written
    unanswered: int = 0    # streams whose reply has not come


class Senders(Generic[Tag, B]):
    """Every shard's send queue and streams, for one worker. Each event returns the streams to start now."""

    def __init__(self, policy: SendPolicy, size_of: Callable[[B], int], offset_of: Callable[[B], int],
                 dropped: Callable[[Tag], bool] = lambda tag: False, trace: list[dict[str, Any]] | None = None):
        self.policy, self.size_of, self.offset_of, self.dropped = policy, size_of, offset_of, dropped
        self.trace = trace
        self._senders: dict[int, _Sender] = {}
        self._streams = 0
        self._syncs: dict[int, tuple[Tag, int]] = {}  # with a trace: id(tag) -> the tag (held) and its number

    # -- events -------------------------------------------------------------------------------------
    def submit(self, group_index: int, tag: Tag, by_shard: Mapping[int, Sequence[B]]) -> list[Stream[Tag, B]]:
        """A sync of group ``group_index`` was taken off the comm queue: queue its blocks at each shard's sender
        (one shard's share never waits for another's); the streams that start now."""
        started: list[Stream[Tag, B]] = []
        for shard in sorted(by_shard):
            sender = self._senders.get(shard)
            if sender is None:
                sender = self._senders[shard] = _Sender(CommQueue(self.policy.priority))
            for block in self.policy.push_order(by_shard[shard], self.offset_of):
                sender.queue.put(group_index, (tag, block))
        for shard in sorted(by_shard):
            started += self._start(shard)
        self._record("submit", started, group_index, tag, by_shard)
        return started

    def written(self, stream: Stream[Tag, B]) -> list[Stream[Tag, B]]:
        """The stream's data is written: the shard's next stream may start."""
        self._senders[stream.shard].writing = False
        started = self._start(stream.shard)
        self._record("written", started, stream=stream.number)
        return started

    def answered(self, stream: Stream[Tag, B]) -> list[Stream[Tag, B]]:
        """The shard answered the stream (or it failed): one stream fewer in flight."""
        self._senders[stream.shard].unanswered -= 1
        started = self._start(stream.shard)
        self._record("answered", started, stream=stream.number)
        return started

    def group_pushes(self, group_index: int, tag: Tag, by_shard: Mapping[int, Sequence[B]]) -> list[Stream[Tag, B]]:
        """Slots scoped to (group, shard): the group's pushes, one per shard, to be made one after another."""
        streams = [self._stream(shard, [(tag, b) for b in self.policy.push_order(by_shard[shard], self.offset_of)])
                   for shard in self.policy.shard_order(by_shard)]
        self._record("group", streams, group_index, tag, by_shard)
        return streams

    def drain(self) -> list[tuple[Tag, B]]:
        """Everything still queued, taken off the queues (the driver failed and fails their syncs)."""
        items = []
        for sender in self._senders.values():
            while len(sender.queue):
                items.append(sender.queue.pop())
        return items

    # -- decisions ------------------------------------------------------------------------------------
    def _start(self, shard: int) -> list[Stream[Tag, B]]:
        sender = self._senders[shard]
        if sender.writing or sender.unanswered >= self.policy.streams_in_flight:
            return []
        batch: list[tuple[Tag, B]] = []
        nbytes = 0
        while len(sender.queue) and (not batch or nbytes < SEND_CREDIT):
            tag, block = sender.queue.pop()
            if self.dropped(tag):
                continue
            batch.append((tag, block))
            nbytes += self.size_of(block)
        if not batch:
            return []
        sender.writing = True
        sender.unanswered += 1
        return [self._stream(shard, batch)]

    def _stream(self, shard: int, items: list[tuple[Tag, B]]) -> Stream[Tag, B]:
        self._streams += 1
        return Stream(self._streams, shard, tuple(items))

    # -- the trace ------------------------------------------------------------------------------------
    def _number(self, tag: Tag) -> int:
        return self._syncs.setdefault(id(tag), (tag, len(self._syncs)))[1]

    def _keys(self, by_shard: Mapping[int, Sequence[B]]) -> dict[int, list[int]]:
        return {shard: [self.offset_of(b) for b in blocks] for shard, blocks in by_shard.items()}

    def _record(self, event: str, started: list[Stream[Tag, B]], group: int = -1, tag: Tag | None = None,
                by_shard: Mapping[int, Sequence[B]] | None = None, stream: int = -1) -> None:
        """With a trace, the event and the streams it started (nothing is computed without one: the comm thread's
        hot path)."""
        if self.trace is None:
            return
        what: dict[str, Any] = {"stream": stream}
        if by_shard is not None and tag is not None:
            what = {"group": group, "sync": self._number(tag), "blocks": self._keys(by_shard)}
        streams = [[s.number, s.shard, [[self._number(t), self.offset_of(b)] for t, b in s.items]] for s in started]
        self.trace.append({"event": event, **what, "streams": streams})


def replay(trace: Sequence[dict[str, Any]], like: Senders[Any, B], block_at: Callable[[int], B]) -> list[dict[str, Any]]:
    """Feed the events of ``trace`` (recorded by a :class:`Senders`) through a fresh kernel with the policy and the
    byte sizes of ``like`` and return what it decided, in the trace's form. ``block_at`` gives the driver's block at
    a flat offset. The result equals ``trace`` when both make the same decisions."""
    senders: Senders[object, B] = Senders(like.policy, like.size_of, like.offset_of, trace=[])
    streams: dict[int, Stream[object, B]] = {}
    syncs: dict[int, object] = {}  # a sync's number in the trace -> the tag it has here
    for event in trace:
        kind = event["event"]
        if kind in ("submit", "group"):
            by_shard = {int(shard): [block_at(offset) for offset in offsets]
                        for shard, offsets in event["blocks"].items()}
            call = senders.submit if kind == "submit" else senders.group_pushes
            started = call(event["group"], syncs.setdefault(event["sync"], object()), by_shard)
        else:
            stream = streams.pop(event["stream"])
            started = senders.written(stream) if kind == "written" else senders.answered(stream)
            if kind == "written":
                streams[stream.number] = stream
        streams.update((s.number, s) for s in started)
    return senders.trace or []
