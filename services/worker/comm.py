"""The worker's comm thread: the queue of complete groups, their pushes and pulls, and the groups' Futures.

The comm loop (an asyncio loop in its own thread) takes groups off the queue
(highest priority first) and starts the group's pull (one stream per shard).
Its blocks join the queues of the shards' senders, one sender per shard, which
push the queued blocks of any groups, highest priority first, a few MiB per
stream, two streams in flight (with slots scoped to the shard port, each stream
holds the port's flag). With slots scoped to (group, shard), the loop instead
pushes the group's shards one after another, each under its flag (see
:mod:`imerge.core.slots`). The shard answers each pulled block as soon as its
round completes, so pulls of early blocks overlap pushes of later ones; each
block is written in place as it arrives and resolves its own Future (a forward
waits only for the blocks that hold its parameters); the group's Future
resolves when all are back. A push fenced off (its flag's lease had passed to
another holder) takes the slot again and is retried.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from imerge.control.messages import PORT, Flag
from imerge.core.errors import Fenced, IMergeError, WaitTimeout
from imerge.core.planning import BYTES_PER_ELEMENT
from imerge.core.queue import PUSHES_IN_FLIGHT, SEND_CREDIT, CommQueue
from imerge.core.slots import NoSlots
from imerge.telemetry.timeline import Timeline

from .buffers import FlatParams, GroupRuntime
from .metrics import WorkerMetrics
from .staging import DONE, HostStaging, Ready, staging_for
from .items import NO_OPTIONS, PushItem, PushOptions
from .transport import ShardClient
from .wire_compression import Compression, meta_nbytes, payload_nbytes

log = logging.getLogger(__name__)
FENCED_RETRIES = 3  # a push fenced off (its flag's lease had passed to another) takes the flag again this often
_STOP = 1 << 30     # queue priority of the item that stops the consumer


@dataclasses.dataclass(frozen=True)
class Sync:
    """One sync of a group: its Futures (the whole group's, and each block's) and the iteration it is of."""

    group: GroupRuntime
    future: concurrent.futures.Future
    block_futures: dict[str, concurrent.futures.Future]
    iteration: int
    options: dict[str, PushOptions]  # block id -> what its push says besides the data
    ready: Ready = DONE  # when the group's gradients may be read for the wire (a device copy's event)

    def fail(self, exc: BaseException) -> None:
        """Route a failed sync to whoever waits on the group or on any of its blocks."""
        for waiting in (self.future, *self.block_futures.values()):
            if not waiting.done():
                waiting.set_exception(exc)


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What the shards say of a completed round besides its parameters."""

    skipped: bool     # the step was skipped: the loss scale let an inf or NaN through
    grad_norm: float  # the global norm of the averaged gradient (when clipping or unscaling; else 0)


class ShardPushes:
    """The pushes of one sync's blocks, spread over the shards' senders: done when the last block is pushed."""

    def __init__(self, sync: Sync, blocks: int):
        self.sync, self.remaining = sync, blocks
        self.failed = False

    def block_pushed(self) -> bool:
        self.remaining -= 1
        return self.remaining == 0

    def fail(self, exc: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        group = self.sync.group
        if group.pull_task is not None:
            group.pull_task.cancel()
        self.sync.fail(exc)
        group.push_done.set()


@dataclasses.dataclass(eq=False)
class ShardSender:
    """One shard's queue of blocks to push (a comparator, as the group queue) and the task that drains it."""

    shard: int
    priority: dataclasses.InitVar[bool]
    in_flight: asyncio.Semaphore  # push streams to the shard not yet answered
    queue: CommQueue = dataclasses.field(init=False)
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    pushes: set = dataclasses.field(default_factory=set)  # the push streams not yet answered
    task: asyncio.Task | None = None

    def __post_init__(self, priority: bool) -> None:
        self.queue = CommQueue(priority)


async def wait_ready(ready: Ready) -> None:
    """Wait (without blocking the comm loop) until a device copy is done."""
    while not ready.query():
        await asyncio.sleep(0.0002)


class CommLoop:
    """The worker's comm thread: an asyncio event loop running in a daemon thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout_s: float, what: str) -> Any:
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}") from None

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class Communicator:
    """Pushes and pulls the groups put on its queue, on the comm loop."""

    def __init__(self, comm: CommLoop, clients: list[ShardClient], flat: FlatParams, slots: NoSlots, *,
                 rank: int, priority: bool, rpc_timeout_s: float, pull_timeout_s: float, generation: int,
                 metrics: WorkerMetrics, timeline: Timeline, slot_scope: str = "group", slot_width: int = 1,
                 compression: dict[str, str] | None = None):
        self.comm, self.clients, self.flat, self.slots = comm, clients, flat, slots
        self.rank, self.generation = rank, generation
        self.slot_scope = slot_scope
        self.lane = rank % slot_width  # with width k, worker w takes lane w mod k
        self.rpc_timeout_s, self.pull_timeout_s = rpc_timeout_s, pull_timeout_s
        self.metrics, self.timeline = metrics, timeline
        self.plan_version = 0
        self.priority = priority
        self.on_push: Callable[[int, float], None] | None = None  # (bytes, seconds) of each shard's push
        self._queue = CommQueue(priority)
        self._queued = asyncio.Event()
        self._senders: dict[int, ShardSender] = {}  # without slots: one per shard
        self.round_results: dict[int, RoundResult] = {}  # by the round a pulled block came back at (the latest)
        self.staging: HostStaging = staging_for(flat)  # device <-> wire (a seam: tests may gate its copies)
        self.arrived: dict[str, Ready] = {}  # block id -> when its latest pulled parameters may be used
        self.compression = Compression(compression or {})
        self._consumer = comm.submit(self._consume())

    # -- the queue (called from the training thread) -------------------------------------
    def enqueue(self, group: GroupRuntime, iteration: int, options: dict[str, PushOptions] | None = None,
                ready: Ready = DONE) -> None:
        """Put a complete group on the queue; its Futures resolve once its new parameters are in place.
        ``options``: per block, what its push says besides the data (hyperparameters, pieces without gradient)."""
        group.push_done.clear()
        group.future = concurrent.futures.Future()
        group.block_futures = {b.block_id: concurrent.futures.Future() for b in group.blocks}
        sync = Sync(group, group.future, group.block_futures, iteration, options or {}, ready)
        self.comm.loop.call_soon_threadsafe(self._put, group.index, sync)

    def _put(self, index: int, item: Any) -> None:
        self._queue.put(index, item)
        self._queued.set()

    async def _consume(self) -> None:
        while True:
            while not len(self._queue):
                await self._queued.wait()
                self._queued.clear()
            sync = self._queue.pop()
            if sync is None:
                return
            group = sync.group
            if group.pull_task is not None:  # the previous round's pull of this group
                await asyncio.wait([group.pull_task])
            group.pull_task = asyncio.get_running_loop().create_task(self._pull_group(sync))
            if self.slots.holds_flags and self.slot_scope == "group":
                try:
                    await self._push_group(sync)
                except Exception as exc:  # routed to whoever waits on the group
                    group.pull_task.cancel()
                    sync.fail(exc)
                finally:
                    group.push_done.set()
            else:
                self._dispatch(sync)

    # -- push: one sender per shard (no slots, or slots scoped to the shard port) ----------------
    def _dispatch(self, sync: Sync) -> None:
        """Queue the group's blocks at each shard's sender; the senders drain their queues independently, so
        one shard's share of a group never waits for another shard's (a group split unevenly over the shards
        would otherwise leave the lighter shards' links idle until the heaviest is done)."""
        group = sync.group
        pending = ShardPushes(sync, len(group.blocks))
        for shard, blocks in group.by_shard.items():
            sender = self._senders.get(shard)
            if sender is None:
                in_flight = 1 if self.slots.holds_flags else PUSHES_IN_FLIGHT  # a flag is held until the reply
                sender = self._senders[shard] = ShardSender(shard, self.priority, asyncio.Semaphore(in_flight))
                sender.task = asyncio.get_running_loop().create_task(self._send_to(sender))
            for block in self._push_order(blocks):
                sender.queue.put(group.index, (pending, block))
            sender.wake.set()

    def _push_order(self, blocks: list) -> list:
        """With priority, a group's blocks in the order the next forward needs them (the reverse of backward
        order), the same on every worker, so the shard completes the earliest layers' blocks first."""
        return sorted(blocks, key=lambda block: -block.offset) if self.priority else blocks

    async def _send_to(self, sender: "ShardSender") -> None:
        """Push the queued blocks to one shard, highest priority first, up to SEND_CREDIT bytes per stream."""
        while True:
            while not len(sender.queue):
                await sender.wake.wait()
                sender.wake.clear()
            batch, nbytes = [], 0
            while len(sender.queue) and (not batch or nbytes < SEND_CREDIT):
                pending, block = sender.queue.pop()
                if pending.failed:
                    continue
                batch.append((pending, block))
                nbytes += self.compression.estimate(block)
            if batch:
                await self._start_batch(sender, batch, nbytes)

    async def _start_batch(self, sender: "ShardSender", batch: list, nbytes: int) -> None:
        """Start a push stream and return once its data is written, so the next stream's data follows without
        waiting for this one's reply (the round trip through the link's queue would leave the stream idle);
        at most PUSHES_IN_FLIGHT streams per shard are unanswered."""
        await sender.in_flight.acquire()
        written = asyncio.Event()
        push = asyncio.get_running_loop().create_task(self._send_batch(sender.shard, batch, nbytes, written))
        sender.pushes.add(push)
        push.add_done_callback(sender.pushes.discard)
        push.add_done_callback(lambda _: sender.in_flight.release())
        all_written = asyncio.ensure_future(written.wait())
        await asyncio.wait([push, all_written], return_when=asyncio.FIRST_COMPLETED)
        all_written.cancel()

    async def _send_batch(self, shard: int, batch: list, nbytes: int, written: asyncio.Event) -> None:
        """One push stream of queued blocks (of any groups and rounds); with slots scoped to the shard's port, made
        holding the port's flag."""
        try:
            for sync in {id(p.sync): p.sync for p, _ in batch}.values():
                await wait_ready(sync.ready)
            items = [self._item(p.sync, b) for p, b in batch]
            nbytes = sum(payload_nbytes(item.grad) for item in items)
            if self.slots.holds_flags:
                span = await self._in_slot(Flag(self.plan_version, PORT, shard, self.lane), nbytes,
                                           lambda fence: self._timed_push(shard, items, nbytes, fence, written))
            else:
                started = time.time()
                await self._timed_push(shard, items, nbytes, 0, written)
                span = started, time.time()
        except Exception as exc:
            for pending, _ in batch:
                pending.fail(exc)
            return
        per_sync: dict[int, list] = {}
        for (pending, block), item in zip(batch, items):
            per_sync.setdefault(id(pending), [pending, 0])[1] += payload_nbytes(item.grad)
        for pending, sync_bytes in per_sync.values():
            self._record_push(shard, span, sync_bytes, group=pending.sync.group.index,
                              iteration=pending.sync.iteration)
        for pending, _ in batch:
            if pending.block_pushed():
                pending.sync.group.push_done.set()

    def _record_push(self, shard: int, span: tuple[float, float], nbytes: int, **args: object) -> None:
        """A push stream (its bytes of one group) on the timeline: from its slot's grant (its start, without
        slots) to the shard's reply."""
        self.timeline.record(f"push ps{shard}", "push", span[0], span[1], shard=shard, bytes=nbytes, **args)

    # -- push with slots scoped to (group, shard) ---------------------------------------------------
    async def _push_group(self, sync: Sync) -> None:
        """Push the group to every shard that holds some of it, one shard after another, worker w starting at its
        w-th shard, so the workers take the shards' ports in turn instead of all queueing for the same one."""
        group = sync.group
        shards = list(group.by_shard)
        start = self.rank % len(shards)
        await wait_ready(sync.ready)
        for shard in shards[start:] + shards[:start]:
            span, nbytes = await self._push_shard_in_slot(sync, shard, group.by_shard[shard])
            self._record_push(shard, span, nbytes, group=group.index, iteration=sync.iteration)

    async def _push_shard_in_slot(self, sync: Sync, shard: int, blocks: list) -> tuple[tuple[float, float], int]:
        """Push the group's blocks of one shard holding the slot of (group, shard). With priority, they go in the
        order the next forward needs them (the reverse of backward order; every worker the same), so the shard
        completes, and answers the pulls of, the earliest layers' blocks first."""
        group = sync.group
        items = [self._item(sync, b) for b in self._push_order(blocks)]
        nbytes = sum(payload_nbytes(item.grad) for item in items)
        span = await self._in_slot(Flag(self.plan_version, group.index, shard, self.lane), nbytes,
                                   lambda fence: self._timed_push(shard, items, nbytes, fence))
        return span, nbytes

    def _item(self, sync: Sync, block: Any) -> PushItem:
        """What a push stream carries of one block, compressed once per sync."""
        grad = self.staging.wire_grads(block.offset, block.numel)
        options = sync.options.get(block.block_id, NO_OPTIONS)
        payload = grad if options.assign else self.compression.compress(block, grad, options.loss_scale > 0)
        if payload is not grad and options.no_grad:
            options = dataclasses.replace(options, no_grad=self.compression.still_without_grad(
                block, payload, options.no_grad, self.flat))
        self.metrics.moved(sync.group.index, "push", block.numel * BYTES_PER_ELEMENT,
                           payload_nbytes(payload))
        return PushItem(block.block_id, payload, sync.group.round, options)

    async def _in_slot(self, flag: Flag, nbytes: int, push: Callable[[int], Awaitable[None]]) -> tuple[float, float]:
        """Make ``push(fence)`` holding the slot ``flag``; take the flag again and retry when fenced off. Returns
        when the push started (its slot granted) and when the shard acknowledged it (wall clock)."""
        for attempt in range(FENCED_RETRIES + 1):
            try:
                async with self.slots.hold(flag, nbytes) as slot:
                    self.timeline.record(f"flag {flag}", "flag-wait", slot.requested, slot.acquired,
                                         group=flag.group, shard=flag.shard, contended=slot.contended)
                    self.metrics.flag_wait.observe(slot.waited_s)
                    await push(slot.fence)
                    acknowledged = time.time()
                self.metrics.flag_held(flag.group, slot.held_s)
                return slot.acquired, acknowledged
            except Fenced as exc:
                if attempt == FENCED_RETRIES:
                    raise
                log.warning("worker %d: %s; taking the flag again", self.rank, exc)

    async def _timed_push(self, shard: int, items: list[PushItem], nbytes: int, fence: int,
                          written: asyncio.Event | None = None) -> None:
        started = time.monotonic()
        await self.clients[shard].push(items, self.rank, self.rpc_timeout_s, self.generation, fence, self.lane,
                                       written=written)
        seconds = time.monotonic() - started
        self.metrics.pushed(shard, nbytes)
        self.slots.observe(nbytes, seconds)
        if self.on_push is not None:
            self.on_push(nbytes, seconds)

    # -- pull ----------------------------------------------------------------------------------
    async def _pull_group(self, sync: Sync) -> None:
        group = sync.group
        try:
            with self.timeline.span(f"pull {group.index}", "pull", group=group.index, round=group.round):
                await asyncio.gather(*(self._pull_shard(sync, shard, blocks)
                                       for shard, blocks in group.by_shard.items()))
            self.metrics.group_synced(group.group.index)
            group.round += 1
            sync.future.set_result(group.round)
        except Exception as exc:
            sync.fail(exc)

    async def _pull_shard(self, sync: Sync, shard: int, blocks: list) -> None:
        group = sync.group
        by_id = {b.block_id: b for b in blocks}

        def arrived(block_id: str, round_: int, meta: Any) -> None:  # in place as soon as the shard completed it
            if round_ != group.round + 1:
                raise IMergeError(f"{group}: block {block_id} came back at round {round_}, expected "
                                  f"{group.round + 1}")
            block = by_id[block_id]
            self.arrived[block_id] = self.staging.block_pulled(block.offset, block.numel)
            self.round_results[round_] = RoundResult(meta.skipped, meta.grad_norm)
            self.round_results.pop(round_ - 8, None)
            sync.block_futures[block_id].set_result(round_)

        wire: dict[str, int] = {}

        def counted(block_id: str, round_: int, meta: Any) -> None:
            wire[block_id] = meta_nbytes(meta)
            arrived(block_id, round_, meta)

        await self.clients[shard].pull_into([(b.block_id, self.flat.host_slice(b)) for b in blocks], self.rank,
                                            group.round, self.pull_timeout_s, self.generation, on_block=counted)
        self.metrics.pulled(shard, sum(wire.values()))
        self.metrics.moved(group.index, "pull", group.shard_bytes(shard), sum(wire.values()))

    # -- closing -------------------------------------------------------------------------------
    def close(self, groups: list[GroupRuntime]) -> None:
        """Stop the consumer, cancel pulls still in flight, close the shard channels."""
        if not self.comm.loop.is_running():
            return
        self.comm.loop.call_soon_threadsafe(self._put, _STOP, None)
        try:
            self._consumer.result(10)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self.comm.run(self._close_clients(groups), 10, "the shard channels to close")

    async def _close_clients(self, groups: list[GroupRuntime]) -> None:
        for sender in self._senders.values():
            for task in (sender.task, *sender.pushes):
                if task is not None:
                    task.cancel()
        for group in groups:
            if group.pull_task is not None and not group.pull_task.done():
                group.pull_task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
