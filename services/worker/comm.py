"""The worker's comm thread: the queue of complete groups, their pushes and pulls, and the groups' Futures.

The comm loop (an asyncio loop in its own thread) takes groups off the queue
(highest priority first), starts the group's pull (one stream per shard) and
pushes the group's blocks (one stream per shard, in the plan's order on every
worker) while holding the group's slot (see :mod:`imerge.core.slots`). The
shard answers each pulled block as soon as its round completes, so pulls of
early blocks overlap pushes of later ones; each block is written in place as
it arrives and resolves its own Future (a forward waits only for the blocks
that hold its parameters); the group's Future resolves when all are back. A
push fenced off (its flag's lease had passed to another holder) takes the
slot again and is retried.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from imerge.control.messages import Flag
from imerge.core.errors import Fenced, IMergeError, WaitTimeout
from imerge.core.queue import CommQueue
from imerge.core.slots import NoSlots
from imerge.telemetry.timeline import Timeline

from .buffers import FlatParams, GroupRuntime
from .metrics import WorkerMetrics
from .transport import ShardClient

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

    def fail(self, exc: BaseException) -> None:
        """Route a failed sync to whoever waits on the group or on any of its blocks."""
        for waiting in (self.future, *self.block_futures.values()):
            if not waiting.done():
                waiting.set_exception(exc)


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
                 metrics: WorkerMetrics, timeline: Timeline):
        self.comm, self.clients, self.flat, self.slots = comm, clients, flat, slots
        self.rank, self.generation = rank, generation
        self.rpc_timeout_s, self.pull_timeout_s = rpc_timeout_s, pull_timeout_s
        self.metrics, self.timeline = metrics, timeline
        self.plan_version = 0
        self.priority = priority
        self.on_push: Callable[[int, float], None] | None = None  # (bytes, seconds) of each shard's push
        self._queue = CommQueue(priority)
        self._queued = asyncio.Event()
        self._consumer = comm.submit(self._consume())

    # -- the queue (called from the training thread) -------------------------------------
    def enqueue(self, group: GroupRuntime, iteration: int) -> None:
        """Put a complete group on the queue; its Futures resolve once its new parameters are in place."""
        group.push_done.clear()
        group.future = concurrent.futures.Future()
        group.block_futures = {b.block_id: concurrent.futures.Future() for b in group.blocks}
        sync = Sync(group, group.future, group.block_futures, iteration)
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
            try:
                await self._push_group(group, sync.iteration)
            except Exception as exc:  # routed to whoever waits on the group
                group.pull_task.cancel()
                sync.fail(exc)
            finally:
                group.push_done.set()

    # -- push ----------------------------------------------------------------------------------
    async def _push_group(self, group: GroupRuntime, iteration: int) -> None:
        """Push the group to every shard that holds some of it. Without slots the streams go at once (the uplink
        is shared); with slots, one shard after another, worker w starting at its w-th shard, so the workers
        take the shards' ports in turn instead of all queueing for the same one."""
        shards = list(group.by_shard)
        if self.slots.holds_flags:
            start = self.rank % len(shards)
            spans = [await self._push_shard_in_slot(group, shard, group.by_shard[shard])
                     for shard in shards[start:] + shards[:start]]
        else:
            spans = await asyncio.gather(*(self._push_shard_in_slot(group, shard, group.by_shard[shard])
                                           for shard in shards))
        self.timeline.record(f"push {group.index}", "push", min(s for s, _ in spans), max(e for _, e in spans),
                             group=group.index, iteration=iteration, round=group.round, bytes=group.nbytes)
        self.flat.grads[group.group.offset:group.group.offset + group.group.numel].zero_()

    async def _push_shard_in_slot(self, group: GroupRuntime, shard: int, blocks: list) -> tuple[float, float]:
        """Push the group's blocks of one shard holding the slot of (group, shard); retry when fenced off.
        Returns when the push started (its slot granted) and when the shard acknowledged it (wall clock)."""
        for attempt in range(FENCED_RETRIES + 1):
            try:
                async with self.slots.hold(Flag(self.plan_version, group.index, shard),
                                           group.shard_bytes(shard)) as slot:
                    if self.slots.holds_flags:
                        self.timeline.record(f"flag {group.index}:{shard}", "flag-wait", slot.requested,
                                             slot.acquired, group=group.index, shard=shard,
                                             contended=slot.contended)
                        self.metrics.flag_wait.observe(slot.waited_s)
                    await self._push_shard(group, shard, blocks, slot.fence)
                    acknowledged = time.time()
                if self.slots.holds_flags:
                    self.metrics.flag_held(group.index, slot.held_s)
                return slot.acquired, acknowledged
            except Fenced as exc:
                if attempt == FENCED_RETRIES:
                    raise
                log.warning("worker %d: %s; taking the flag again", self.rank, exc)

    async def _push_shard(self, group: GroupRuntime, shard: int, blocks: list, fence: int) -> None:
        """With priority, a group's blocks go in the order the next forward needs them (the reverse of backward
        order; every worker the same), so the shard completes, and answers the pulls of, the earliest layers'
        blocks first and the forward can start while the later blocks are still on the wire."""
        if self.priority:
            blocks = sorted(blocks, key=lambda block: -block.offset)
        started = time.monotonic()
        await self.clients[shard].push([(b.block_id, self.flat.grad_slice(b)) for b in blocks], self.rank,
                                       group.round, self.rpc_timeout_s, self.generation, fence)
        seconds, nbytes = time.monotonic() - started, group.shard_bytes(shard)
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

        def arrived(block_id: str, round_: int) -> None:  # in place as soon as the shard completed it
            if round_ != group.round + 1:
                raise IMergeError(f"{group}: block {block_id} came back at round {round_}, expected "
                                  f"{group.round + 1}")
            block = by_id[block_id]
            self.flat.load_from_host(block.offset, block.numel)
            sync.block_futures[block_id].set_result(round_)

        await self.clients[shard].pull_into([(b.block_id, self.flat.host_slice(b)) for b in blocks], self.rank,
                                            group.round, self.pull_timeout_s, self.generation, on_block=arrived)
        self.metrics.pulled(shard, group.shard_bytes(shard))

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
        for group in groups:
            if group.pull_task is not None and not group.pull_task.done():
                group.pull_task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
