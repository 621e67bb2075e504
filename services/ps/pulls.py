"""What a request names, checked (the generation, the block, the worker), and the pulls: a mixin of
:class:`~.state.Shard`.

A pull waits until every worker pushed the round it names of each block, and gets the blocks as their rounds
complete. It waits on the event loop (:meth:`Pulls.pull_blocks`, the gRPC path's) or on a data connection's own
thread (:func:`~.direct.pull_here`); a round completes on either (:meth:`~.state.Shard.aggregate_here`), so
both wake up alike: each block calls its waiters, which may be on any thread.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence

from imerge.core.errors import (DeadlineExceeded, FailedPrecondition, FutureGeneration, InvalidArgument, NotFound,
                                StaleGeneration)
from imerge.core.handover import hand_over
from imerge.core.limits import clip

from .block import BlockState, Snapshot
from .metrics import ShardCounters, ShardMetrics

PulledBlock = tuple[str, int, Snapshot, tuple[bool, float]]  # (block id, new round, parameters, its result)


class Pulls:
    index: int
    generation: int
    blocks: dict[str, BlockState]
    counters: ShardCounters
    metrics: ShardMetrics
    job_failure: tuple[int, str] | None = None  # (the generation it ended, why): the job failed for good

    # -- generations ------------------------------------------------------------
    def fail_job(self, why: str) -> None:
        """The job failed for good (the coordinator said so): the calls of the shard's generation are refused
        with ``why`` from now on, and the pulls waiting for a round end at once instead of at their timeout."""
        self.job_failure = (self.generation, why)
        for block in list(self.blocks.values()):
            block.wake()

    def check_job(self, what: str) -> None:
        """Refuse a call once the job failed (in the shard's generation: a restore to a later one lifts it)."""
        failure = self.job_failure
        if failure is not None and failure[0] == self.generation:
            raise FailedPrecondition(f"{what}: shard {self.index}: the job failed: {failure[1]}")

    def check_generation(self, generation: int, what: str) -> None:
        self.check_job(what)
        if generation < self.generation:
            self.counters.stale_generation += 1
            raise StaleGeneration(f"{what}: generation {generation} is stale; the job is at generation "
                                  f"{self.generation} (it recovered from a checkpoint): rejoin")
        if generation > self.generation:
            raise FutureGeneration(f"{what}: shard {self.index} is at generation {self.generation} and has not "
                                   f"restored generation {generation} yet")

    def block(self, block_id: str) -> BlockState:
        try:
            return self.blocks[block_id]
        except KeyError:
            raise NotFound(f"block {clip(block_id)!r} is not on shard {self.index}") from None

    def _check_worker(self, block: BlockState, worker: int) -> None:
        if not 0 <= worker < block.meta.num_workers:
            raise InvalidArgument(f"block {block.meta.block_id}: worker {worker} outside "
                                  f"0..{block.meta.num_workers - 1}")

    # -- pull -----------------------------------------------------------------
    async def pull_blocks(self, block_ids: Sequence[str], worker: int, round_: int, timeout_s: float,
                          generation: int = 0) -> AsyncGenerator[list[PulledBlock], None]:
        """Wait until every worker pushed ``round_`` of each block (this worker's push may still come: a worker
        pulls while it pushes); yield the blocks as their rounds complete, as (id, new round, parameters,
        (step skipped, gradient norm)), those that completed together in the order asked. Every block is
        checked before any is waited for; the first failure ends the pull. The caller is woken once per batch
        of blocks that completed, never once per block."""
        loop = asyncio.get_running_loop()
        pull = PullLooks(self, block_ids, worker, round_, timeout_s, generation, loop.time)
        wake: asyncio.Future[None] = loop.create_future()

        def changed() -> None:  # a round may complete on a data connection's thread (a closed loop: no one waits)
            hand_over(loop, wake, None, False)

        with self.waiting_on(pull.blocks, changed):
            while pull.waiting:
                if ready := pull.look():
                    yield ready
                    continue
                try:
                    async with asyncio.timeout_at(pull.deadline):
                        await wake
                except TimeoutError:
                    raise pull.timed_out() from None
                wake = loop.create_future()

    def pull_checked(self, block_ids: Sequence[str], worker: int, round_: int, generation: int
                     ) -> list[tuple[str, BlockState]]:
        """The blocks a pull names, each checked (the generation first), before any is waited for."""
        self.check_generation(generation, f"pull by worker {worker} for round {round_}")
        blocks = [(block_id, self.pullable(block_id, worker, round_)) for block_id in block_ids]
        self.counters.add(pulls=len(blocks))
        return blocks

    @staticmethod
    @contextlib.contextmanager
    def waiting_on(blocks: list[BlockState], changed: Callable[[], None]) -> Iterator[None]:
        """While a pull waits: ``changed`` is called (on the event loop) whenever one of ``blocks`` completes or
        fails a round, or is replaced."""
        for block in blocks:
            block.waiters.add(changed)
        try:
            yield
        finally:
            for block in blocks:
                block.waiters.discard(changed)

    def pull_ready(self, waiting: list[tuple[str, BlockState]], worker: int, round_: int
                   ) -> tuple[list[PulledBlock], list[tuple[str, BlockState]]]:
        """Of the blocks a pull waits for, those whose round completed (in the order asked), and the rest."""
        self.check_job(f"pull by worker {worker} for round {round_}")
        ready, still = [], []
        for block_id, block in waiting:
            item = self.pulled(block_id, block, worker, round_)
            if item is None:
                still.append((block_id, block))
            else:
                ready.append(item)
        return ready, still

    def pullable(self, block_id: str, worker: int, round_: int) -> BlockState:
        """The block a pull of ``round_`` names, checked: it exists, has the worker, and is at that round or the
        next."""
        block = self.block(block_id)
        self._check_worker(block, worker)
        block.rounds.check_pull(worker, round_)
        return block

    def pulled(self, block_id: str, block: BlockState, worker: int, round_: int) -> PulledBlock | None:
        """The block's parameters after ``round_`` once it completed (None while it has not). Read from any
        thread: the snapshot is the one published with the round read (the loop publishes it first)."""
        while True:
            snapshot = block.snapshot
            try:
                done = block.rounds.pulled(worker, round_)
            except StaleGeneration:
                self.counters.add(stale_generation=1)
                raise
            if done is None:
                return None
            if block.snapshot is snapshot:
                return block_id, done[0], snapshot, done[1]


class PullLooks:
    """One pull's looks at its blocks: those it still waits for, and when it must give up (``clock``: the
    waiting thread's, seconds)."""

    def __init__(self, shard: Pulls, block_ids: Sequence[str], worker: int, round_: int, timeout_s: float,
                 generation: int, clock: Callable[[], float]):
        self.waiting = shard.pull_checked(block_ids, worker, round_, generation)
        self.blocks = [block for _, block in self.waiting]
        self._shard, self._worker, self._round, self._timeout_s, self._clock = shard, worker, round_, timeout_s, clock
        self._started, self._looks = clock(), 0
        self.deadline = self._started + timeout_s

    def look(self) -> list[PulledBlock]:
        """The blocks whose round completed since the last look (none: wait for a change, or the deadline)."""
        ready, self.waiting = self._shard.pull_ready(self.waiting, self._worker, self._round)
        self._looks += 1
        if ready and self._looks > 1:  # they were waited for
            for _ in ready:
                self._shard.metrics.pull_wait.observe(self._clock() - self._started)
        return ready

    def timed_out(self) -> DeadlineExceeded:
        block_id, block = self.waiting[0]
        missing = block.rounds.missing()
        reason = f"workers {missing} have not pushed" if missing else "the aggregation is still running"
        return DeadlineExceeded(f"pull of block {block_id} by worker {self._worker} for round {self._round}: "
                                f"timed out after {self._timeout_s:g}s; {reason}")
