"""The worker's comm thread: the queue of complete groups, their pushes and pulls, and the groups' Futures.

The comm loop (an asyncio loop in its own thread) takes groups off the queue
(highest priority first), starts the group's pull (one stream per shard) and
hands its blocks to the pushes (:mod:`.pushes`). The shard answers each pulled
block as soon as its round completes, so pulls of early blocks overlap pushes
of later ones; each block is written in place as it arrives and resolves its
own Future (a forward waits only for the blocks that hold its parameters); the
group's Future resolves when all are back.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from imerge.control.store import WorkerStore
from imerge.core.errors import Cancelled, IMergeError, WaitTimeout
from imerge.core.knobs import apply
from imerge.core.modes import BlockMode, block_modes
from imerge.core.planning import Plan
from imerge.core.queue import STOP, CommQueue
from imerge.core.scheduling import thread_under
from imerge.core.slots import NoSlots, effective_policy, make_slots, resolve_width
from imerge.telemetry.timeline import Timeline

from .buffers import FlatParams
from .config import WorkerConfig
from .groups import RoundResult, Sync
from .metrics import WorkerMetrics
from .pushes import Pusher
from .staging import HostStaging, Ready, staging_for
from .transport import ShardClient
from .wire_compression import Compression, meta_nbytes

log = logging.getLogger(__name__)
T = TypeVar("T")
SETTLE_PUSHES_S = 5.0  # how long a worker that leaves cleanly waits for its answered push streams to end


class CommLoop:
    """The worker's comm thread: an asyncio event loop running in a daemon thread, under ``thread_policy``
    (:mod:`imerge.core.scheduling`), which the data channel's call threads it starts inherit."""

    def __init__(self, name: str, thread_policy: str = "normal"):
        self.loop = asyncio.new_event_loop()
        self._thread = thread_under(thread_policy, self.loop.run_forever, name)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}") from None

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the comm thread %s is still running %gs after it was asked to stop",
                            self._thread.name, timeout_s)


class Communicator:
    """Pushes and pulls the groups put on its queue, on the comm loop."""

    def __init__(self, comm: CommLoop, clients: list[ShardClient], flat: FlatParams, slots: NoSlots, *,
                 rank: int, priority: bool, rpc_timeout_s: float, pull_timeout_s: float, generation: int,
                 metrics: WorkerMetrics, timeline: Timeline, slot_scope: str = "group", slot_width: int = 1,
                 compression: dict[str, BlockMode] | None = None):
        self.comm, self.clients, self.flat = comm, clients, flat
        self.rank, self.generation, self.pull_timeout_s = rank, generation, pull_timeout_s
        self.metrics, self.timeline = metrics, timeline
        self.staging: HostStaging = staging_for(flat)  # device <-> wire (a seam: tests may gate its copies)
        self.compression = Compression(compression or {})
        self.pusher = Pusher(clients, flat, slots, self.staging, self.compression, metrics, timeline, rank=rank,
                             priority=priority, rpc_timeout_s=rpc_timeout_s, generation=generation,
                             slot_scope=slot_scope, lane=rank % slot_width)
        self._queue = CommQueue(priority)
        self._queued = asyncio.Event()
        self._pulls: dict[int, asyncio.Task[None]] = {}  # group index -> its latest pull (the comm loop's)
        # written by the comm thread only; the training thread reads them
        self.round_results: dict[int, RoundResult] = {}  # by the round a pulled block came back at (the latest)
        self.arrived: dict[str, Ready] = {}  # block id -> when its latest pulled parameters may be used
        self.broken: IMergeError | None = None  # the comm thread failed (a bug): every sync fails with this
        self.pusher.on_crash = self._crashed
        self._consumer = comm.submit(self._consume())

    @property
    def plan_version(self) -> int:
        return self.pusher.plan_version

    @plan_version.setter
    def plan_version(self, version: int) -> None:
        self.pusher.plan_version = version

    @property
    def on_push(self) -> Callable[[int, float], None] | None:
        return self.pusher.on_push

    @on_push.setter
    def on_push(self, observe: Callable[[int, float], None] | None) -> None:
        self.pusher.on_push = observe

    def use_schedule(self, priority: bool, slots: NoSlots, slot_scope: str, slot_width: int) -> None:
        """Push with another priority and slot policy from now on (a plan switch: every sync completed)."""

        async def switch() -> None:
            if len(self._queue) or self.pusher.streams:
                raise IMergeError("the schedule can change only with no push queued or in flight")
            self._queue = CommQueue(priority)
            self.pusher.use(priority, slots, slot_scope, self.rank % slot_width)

        self.comm.run(switch(), 10, "the comm thread to take the new schedule")

    # -- the queue (called from the training thread) -------------------------------------
    def enqueue(self, sync: Sync) -> None:
        """Put a complete group's sync on the queue; its Futures resolve once its new parameters are in place."""
        self.comm.loop.call_soon_threadsafe(self._put, sync.group.index, sync)

    def _put(self, index: int, item: Sync | None) -> None:
        if self.broken is not None and item is not None:
            item.fail(self.broken)
            return
        self._queue.put(index, item)
        self._queued.set()

    async def _consume(self) -> None:
        sync: Sync | None = None
        try:
            while True:
                while not len(self._queue):
                    await self._queued.wait()
                    self._queued.clear()
                sync = self._queue.pop()
                if sync is None:
                    return
                await self._start(sync)
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the job at once, not leave it waiting
            self._crashed(exc, [sync] if sync is not None else [])

    def _crashed(self, exc: BaseException, current: list[Sync]) -> None:
        """The comm thread hit a bug: the sync it held and every queued one fail now, naming it, and so does every
        later one (the training thread raises it at its next wait instead of timing out)."""
        if self.broken is None:
            log.error("worker %d: the comm thread failed", self.rank, exc_info=exc)
            self.broken = IMergeError(f"worker {self.rank}: the comm thread failed: {type(exc).__name__}: {exc}")
            self.broken.__cause__ = exc
        while len(self._queue):
            queued = self._queue.pop()
            if queued is not None:
                current.append(queued)
        for sync in current:
            sync.fail(self.broken)

    async def _start(self, sync: Sync) -> None:
        """Start the sync's pull (after the group's previous one) and hand its blocks to the pushes."""
        index = sync.group.index
        previous = self._pulls.get(index)
        if previous is not None and not previous.done():  # the previous round's pull of this group
            await asyncio.wait([previous])
        pull = self._pulls[index] = asyncio.get_running_loop().create_task(self._pull_group(sync))
        if self.pusher.per_group:
            try:
                await self.pusher.push_group(sync)
            except Exception as exc:  # routed to whoever waits on the group
                pull.cancel()
                sync.fail(exc)
            finally:
                sync.pushed.set()
        else:
            self.pusher.dispatch(sync, lambda: pull.cancel())

    # -- pull ----------------------------------------------------------------------------------
    async def _pull_group(self, sync: Sync) -> None:
        group = sync.group
        try:
            with self.timeline.span(f"pull {group.index}", "pull", group=group.index, round=sync.round):
                pulls = [self._pull_shard(sync, shard, blocks) for shard, blocks in group.by_shard.items()]
                await (pulls[0] if len(pulls) == 1 else asyncio.gather(*pulls))  # one shard: no task of its own
            self.metrics.group_synced(group.index)
            sync.future.set_result(sync.round + 1)
        except Exception as exc:
            sync.fail(exc)
        except asyncio.CancelledError:  # a failed push (which failed the sync first: no-op) or the worker leaving
            sync.fail(Cancelled(f"{group}: the pull of round {sync.round} ended: the worker left the job "
                                "(abort or close) while it was waited for"))
            raise

    async def _pull_shard(self, sync: Sync, shard: int, blocks: list[Any]) -> None:
        group = sync.group
        by_id = {b.block_id: b for b in blocks}
        wire: dict[str, int] = {}

        def arrived(block_id: str, round_: int, meta: Any) -> None:  # in place as soon as the shard completed it
            # (on a data connection's thread or the comm loop: what it touches is thread-safe)
            if round_ != sync.round + 1:
                raise IMergeError(f"{group}: block {block_id} came back at round {round_}, expected "
                                  f"{sync.round + 1}")
            block = by_id[block_id]
            wire[block_id] = meta_nbytes(meta)
            self.arrived[block_id] = self.staging.block_pulled(block.offset, block.numel)
            self.round_results[round_] = RoundResult(meta.skipped, meta.grad_norm)
            self.round_results.pop(round_ - 8, None)
            sync.block_futures[block_id].set_result(round_)

        await self.clients[shard].pull_into([(b.block_id, self.flat.host_slice(b)) for b in blocks], self.rank,
                                            sync.round, self.pull_timeout_s, self.generation, on_block=arrived)
        self.metrics.pulled(shard, sum(wire.values()))
        self.metrics.moved(group.index, "pull", group.shard_bytes(shard), sum(wire.values()))

    # -- closing -------------------------------------------------------------------------------
    def settle_pushes(self, timeout_s: float = SETTLE_PUSHES_S) -> None:
        """Wait, at most ``timeout_s``, until the push streams in flight have ended. Called once every group's
        last pull is in: every push was answered then, and what a stream has left to do (its timeline entry, its
        counters, its slot's release) would otherwise be cancelled by :meth:`close` where its thread handed the
        answer over after the pull's."""

        async def settled() -> None:
            if self.pusher.streams:
                await asyncio.wait(list(self.pusher.streams), timeout=timeout_s)

        if self.comm.loop.is_running():
            self.comm.run(settled(), timeout_s + 5.0, "the push streams to end")

    def close(self) -> None:
        """Stop the consumer, cancel pulls still in flight, close the shard channels."""
        if not self.comm.loop.is_running():
            return
        self.comm.loop.call_soon_threadsafe(self._put, STOP, None)
        try:
            self._consumer.result(10)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self.comm.run(self._close_clients(), 10, "the shard channels to close")

    async def _close_clients(self) -> None:
        self.pusher.cancel()
        for pull in self._pulls.values():
            if not pull.done():
                pull.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)


def open_comm(loop: CommLoop, config: WorkerConfig, plan: Plan, store: WorkerStore, flat: FlatParams,
              metrics: WorkerMetrics, timeline: Timeline, generation: int) -> Communicator:
    """The worker's communicator for ``plan``: a channel per shard, the slot policy the flags call for."""

    async def connect() -> list[ShardClient]:  # on the comm loop, which the channels belong to
        return [ShardClient(address, config, config.data_path) for address in plan.shard_addresses]

    clients = loop.run(connect(), 30, "the shard channels to open")
    config = apply(config, plan.knobs)  # a plan chosen by --tune: its knobs (a rejoining worker's too)
    slots, width = slot_policy(config, plan, store, generation)
    return Communicator(loop, clients, flat, slots, rank=config.rank, priority=config.priority,
                        rpc_timeout_s=config.rpc_timeout_s, pull_timeout_s=config.pull_timeout_s,
                        generation=generation, metrics=metrics, timeline=timeline, slot_scope=config.slot_scope,
                        slot_width=width, compression=block_modes(config.compression_spec(), plan))


def slot_policy(config: WorkerConfig, plan: Plan, store: WorkerStore, generation: int) -> tuple[NoSlots, int]:
    """The slot policy the options call for on ``plan``'s cluster, and its width."""
    width = resolve_width(config.slot_scope, config.slot_width, len(plan.shard_addresses))
    policy = effective_policy(config.slots, width, plan.num_workers)
    if policy != config.slots:
        log.info("worker %d: slots %s with width %d >= %d workers guard nothing; pushing without flags",
                 config.rank, config.slots, width, plan.num_workers)
    return make_slots(policy, store, owner=f"w{config.rank}", lease_s=config.flag_lease_s,
                      timeout_s=config.pull_timeout_s, generation=generation,
                      bandwidth_mbps=config.slot_bandwidth_mbps), width
