"""The push side of the comm thread: blocks to the shards under the slot policy.

What to send and when is decided by the sending kernel
(:mod:`imerge.core.sending`, which the simulator runs too); this module carries
its streams out. Without slots, or with slots scoped to the shard port, a
group's blocks join the queues of the shards' senders, which push the queued
blocks of any groups, highest priority first, a few MiB per stream, two
streams in flight (with port slots each stream holds the port's flag). With
slots scoped to (group, shard), the group's shards are pushed one after
another, each under its flag (see :mod:`imerge.core.slots`). A push fenced off
(its flag's lease had passed to another holder) takes the slot again and is
retried. Everything here runs on the comm loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from imerge.control.messages import PORT, Flag
from imerge.core.compression import Payload
from imerge.core.errors import Fenced
from imerge.core.planning import BYTES_PER_ELEMENT, Block
from imerge.core.rounds import NO_OPTIONS
from imerge.core.sending import SendPolicy, Senders, Stream
from imerge.core.slots import NoSlots
from imerge.telemetry.timeline import Timeline

from .buffers import FlatParams
from .groups import Sync
from .items import PushItem
from .metrics import WorkerMetrics
from .staging import HostStaging, Ready
from .transport import ShardClient
from .wire_compression import Compression, payload_nbytes

log = logging.getLogger(__name__)
FENCED_RETRIES = 3  # a push fenced off (its flag's lease had passed to another) takes the flag again this often


class ShardPushes:
    """The pushes of one sync's blocks, spread over the shards' senders: done when the last block is pushed."""

    def __init__(self, sync: Sync, blocks: int, cancel_pull: Callable[[], object]):
        self.sync, self.remaining = sync, blocks
        self.cancel_pull = cancel_pull
        self.failed = False

    def block_pushed(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.sync.pushed.set()

    def fail(self, exc: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        self.cancel_pull()
        self.sync.fail(exc)


async def wait_ready(ready: Ready) -> None:
    """Wait (without blocking the comm loop) until a device copy is done."""
    while not ready.query():
        await asyncio.sleep(0.0002)


@dataclasses.dataclass(eq=False)
class Pusher:
    """Pushes syncs' blocks to the shards (on the comm loop)."""

    clients: list[ShardClient]
    flat: FlatParams
    slots: NoSlots
    staging: HostStaging
    compression: Compression
    metrics: WorkerMetrics
    timeline: Timeline
    rank: int
    priority: bool
    rpc_timeout_s: float
    generation: int
    slot_scope: str = "group"
    lane: int = 0  # with slot width k, worker w takes lane w mod k
    plan_version: int = 0
    on_push: Callable[[int, float], None] | None = None  # (bytes, seconds) of each shard's push
    on_crash: Callable[[BaseException, list[Sync]], None] | None = None  # a stream failed (a bug)
    senders: Senders[ShardPushes, Block] = dataclasses.field(init=False)  # the schedule (one kernel)
    streams: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)  # the push streams not yet answered

    def __post_init__(self) -> None:
        self.use(self.priority, self.slots, self.slot_scope, self.lane)

    def use(self, priority: bool, slots: NoSlots, slot_scope: str, lane: int) -> None:
        """Schedule the pushes from now on with this priority and slot policy (nothing queued: a fresh kernel)."""
        self.priority, self.slots, self.slot_scope, self.lane = priority, slots, slot_scope, lane
        policy = SendPolicy(priority, slots.holds_flags, slot_scope, self.rank)
        self.senders = Senders(policy, self.compression.estimate, lambda block: block.offset,
                               dropped=lambda pending: pending.failed)

    @property
    def per_group(self) -> bool:
        """Whether a group is pushed whole, shard after shard, under its (group, shard) flags."""
        return self.senders.policy.per_group

    # -- one sender per shard (no slots, or slots scoped to the shard port) ----------------------
    def dispatch(self, sync: Sync, cancel_pull: Callable[[], object]) -> None:
        """Queue the group's blocks at each shard's sender (:class:`Senders`); the shards' streams go
        independently, so one shard's share of a group never waits for another's (a group split unevenly over the
        shards would otherwise leave the lighter shards' links idle until the heaviest is done)."""
        pending = ShardPushes(sync, len(sync.group.blocks), cancel_pull)
        self._start(self.senders.submit(sync.group.index, pending, sync.group.by_shard))

    def _start(self, streams: list[Stream[ShardPushes, Block]]) -> None:
        for stream in streams:
            task = asyncio.get_running_loop().create_task(self._stream(stream))
            self.streams.add(task)
            task.add_done_callback(self.streams.discard)

    async def _stream(self, stream: Stream[ShardPushes, Block]) -> None:
        """One push stream; once its data is written the shard's next stream may start (its reply is not
        awaited: the round trip through the link's queue would leave the link idle), and once it is answered
        one fewer is in flight."""
        batch = list(stream.items)
        written = False

        def on_written() -> None:  # on the comm loop, called by the data path once the last byte is handed over
            nonlocal written
            if written:
                return
            written = True
            try:
                self._start(self.senders.written(stream))
            except Exception as exc:  # noqa: BLE001 - a bug here must fail the job at once, not leave it waiting
                self._crash(exc, batch)

        try:
            await self._send_batch(stream.shard, batch, on_written)
            on_written()  # a push that failed before its data was all written
            self._start(self.senders.answered(stream))
        except asyncio.CancelledError:  # the worker is leaving: a late word of the write starts nothing
            written = True
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the job at once, not leave it waiting
            self._crash(exc, batch)

    def _crash(self, exc: BaseException, batch: list[tuple[ShardPushes, Block]]) -> None:
        if self.on_crash is not None:
            self.on_crash(exc, [pending.sync for pending, _ in batch + self.senders.drain()])

    async def _send_batch(self, shard: int, batch: list[tuple[ShardPushes, Block]],
                          on_written: Callable[[], None]) -> None:
        """One push stream of queued blocks (of any groups and rounds); with slots scoped to the shard's port, made
        holding the port's flag."""
        try:
            for sync in {id(p.sync): p.sync for p, _ in batch}.values():
                await wait_ready(sync.ready)
            items = [self._item(p.sync, b) for p, b in batch]
            nbytes = sum(payload_nbytes(item.grad) for item in items)

            def acknowledged(span: tuple[float, float]) -> None:  # a timeline entry per group the stream carried
                per_sync: dict[int, tuple[ShardPushes, int]] = {}
                for (pending, _), item in zip(batch, items):
                    previous = per_sync.get(id(pending), (pending, 0))[1]
                    per_sync[id(pending)] = pending, previous + payload_nbytes(item.grad)
                for pending, sync_bytes in per_sync.values():
                    self._record_push(shard, span, sync_bytes, group=pending.sync.group.index,
                                      iteration=pending.sync.iteration)

            if self.slots.holds_flags:
                await self._in_slot(Flag(self.plan_version, PORT, shard, self.lane), nbytes,
                                    lambda fence: self._timed_push(shard, items, nbytes, fence, on_written),
                                    acknowledged)
            else:
                started = time.time()
                await self._timed_push(shard, items, nbytes, 0, on_written)
                acknowledged((started, time.time()))
        except Exception as exc:
            for pending, _ in batch:
                pending.fail(exc)
            return
        for pending, _ in batch:
            pending.block_pushed()

    def _record_push(self, shard: int, span: tuple[float, float], nbytes: int, **args: object) -> None:
        """A push stream (its bytes of one group) on the timeline: from its slot's grant (its start, without
        slots) to the shard's reply."""
        self.timeline.record(f"push ps{shard}", "push", span[0], span[1], shard=shard, bytes=nbytes, **args)

    # -- slots scoped to (group, shard) ----------------------------------------------------------
    async def push_group(self, sync: Sync) -> None:
        """Push the group to every shard that holds some of it, one shard after another, worker w starting at its
        w-th shard, so the workers take the shards' ports in turn instead of all queueing for the same one."""
        group = sync.group
        await wait_ready(sync.ready)
        for stream in self.senders.group_pushes(group.index, ShardPushes(sync, len(group.blocks), lambda: None),
                                                group.by_shard):
            shard = stream.shard
            items = [self._item(sync, b) for _, b in stream.items]
            nbytes = sum(payload_nbytes(item.grad) for item in items)
            await self._in_slot(Flag(self.plan_version, group.index, shard, self.lane), nbytes,
                                lambda fence: self._timed_push(shard, items, nbytes, fence),
                                lambda span: self._record_push(shard, span, nbytes, group=group.index,
                                                               iteration=sync.iteration))

    def _item(self, sync: Sync, block: Block) -> PushItem:
        """What a push stream carries of one block, compressed once per sync."""
        grad = self.staging.wire_grads(block.offset, block.numel)
        options, no_grad = sync.options.get(block.block_id, NO_OPTIONS), sync.no_grad.get(block.block_id, ())
        payload = grad if options.assign else self.compression.compress(block, grad, options.loss_scale > 0)
        if isinstance(payload, Payload) and no_grad:
            no_grad = self.compression.still_without_grad(block, payload, no_grad, self.flat)
        self.metrics.moved(sync.group.index, "push", block.numel * BYTES_PER_ELEMENT, payload_nbytes(payload))
        return PushItem(block.block_id, payload, sync.round, options, no_grad)

    async def _in_slot(self, flag: Flag, nbytes: int, push: Callable[[int], Awaitable[None]],
                       acknowledged: Callable[[tuple[float, float]], None]) -> None:
        """Make ``push(fence)`` holding the slot ``flag``; take the flag again and retry when fenced off.
        ``acknowledged`` gets when the push started (its slot granted) and when the shard acknowledged it (wall
        clock) at once, before the slot's release: the round may complete, and the job end, before the release's
        round trip to the store returns."""
        for attempt in range(FENCED_RETRIES + 1):
            try:
                async with self.slots.hold(flag, nbytes) as slot:
                    self.timeline.record(f"flag {flag}", "flag-wait", slot.requested, slot.acquired,
                                         group=flag.group, shard=flag.shard, contended=slot.contended)
                    self.metrics.flag_wait.observe(slot.waited_s)
                    await push(slot.fence)
                    acknowledged((slot.acquired, time.time()))
                self.metrics.flag_held(flag.group, slot.held_s)
                return
            except Fenced as exc:
                if attempt == FENCED_RETRIES:
                    raise
                log.warning("worker %d: %s; taking the flag again", self.rank, exc)
        raise AssertionError("unreachable: the last attempt re-raises or returns")

    async def _timed_push(self, shard: int, items: list[PushItem], nbytes: int, fence: int,
                          on_written: Callable[[], None] | None = None) -> None:
        started = time.monotonic()
        await self.clients[shard].push(items, self.rank, self.rpc_timeout_s, self.generation, fence, self.lane,
                                       on_written=on_written)
        seconds = time.monotonic() - started
        self.metrics.pushed(shard, nbytes)
        self.slots.observe(nbytes, seconds)
        if self.on_push is not None:
            self.on_push(nbytes, seconds)

    def cancel(self) -> None:
        for stream in list(self.streams):
            stream.cancel()
